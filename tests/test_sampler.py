"""On-device sampling: parameter validation, filters, exactness of the draws, seed independence."""
import math

import pytest
import torch

from compiled_spec.sampler import (SamplingTensors, _mix32, apply_filters, bits_to_unit,
                                   position_keys, row_uniform, sample, sample_from_probs,
                                   uniform_noise)
from compiled_spec.sampling_params import SamplingParams


def _st(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None):
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + 3 if seeds is None else seeds
    return SamplingTensors(
        temperature=torch.full((n,), float(temperature)), top_k=torch.full((n,), top_k),
        top_p=torch.full((n,), float(top_p)), min_p=torch.full((n,), float(min_p)), seeds=seeds,
        all_greedy=temperature == 0, any_sorting=top_k > 0 or top_p < 1, any_min_p=min_p > 0)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.5),
    ("max_tokens", 0), ("seed", "abc"), ("stop_token_ids", [-3]),
])
def test_bad_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_uniform_noise_is_uniform_and_keyed():
    keys = position_keys(torch.tensor([1, 1, 2]), torch.tensor([5, 6, 5]))
    assert len(set(keys.tolist())) == 3
    u = uniform_noise(keys, 20000)
    assert (u > 0).all() and (u < 1).all()
    for row in u:
        assert abs(row.mean().item() - 0.5) < 0.01
        assert abs(row.var().item() - 1 / 12) < 0.003
    # Same key, same noise: reproducible by construction.
    assert torch.equal(uniform_noise(keys[:1], 50), uniform_noise(keys[:1], 50))


def test_hash_to_uniform_never_reaches_0_or_1():
    # Exhaustive over the top and bottom 2**20 hash values: the old 24-bit mapping turned the
    # top 256 of them into exactly 1.0 (then -log(u) = 0 and the race picked p = 0 tokens).
    top = torch.arange(2**32 - 2**20, 2**32, dtype=torch.int64)
    bottom = torch.arange(0, 2**20, dtype=torch.int64)
    for h in (top, bottom):
        u = bits_to_unit(h)
        assert (u > 0).all() and (u < 1).all()
        assert torch.isfinite(-torch.log(u)).all() and (-torch.log(u) > 0).all()


def test_row_uniform_stays_inside_0_1_at_the_extremes():
    # Keys whose two hashes hit the extreme 23-bit values map to (0.5 / 2**46) and
    # (2**46 - 0.5) / 2**46, both exact in float64; scan enough keys to meet many near-extremes.
    keys = torch.arange(0, 2**22, dtype=torch.int64) * 1021
    u = row_uniform(keys)
    assert u.dtype == torch.float64 and (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 1e-3
    top = torch.tensor([2**23 - 1], dtype=torch.float64)
    assert ((top * 2**23 + top + 0.5) / 2**46).item() < 1.0
    assert torch.equal(_mix32(keys[:8]), _mix32(keys[:8]))


def test_race_never_picks_a_zero_probability_token():
    # Two-token support inside a 65,536-wide vocabulary: each row draws 65,536 noises, so 4,096
    # rows see ~2.7e8 draws, where the old mapping hit u == 1.0 about 16 times (a NaN ratio that
    # argmax takes). Greedy (one-hot) rows share the batch, as they do in the engine.
    width, rows = 65536, 4096
    probs = torch.zeros(256, width)
    probs[:, 7], probs[:, 40000] = 0.6, 0.4
    probs[::4] = 0.0
    probs[::4, 123] = 1.0  # greedy rows: one-hot
    for start in range(0, rows, 256):
        keys = position_keys(torch.full((256,), 99), torch.arange(start, start + 256))
        toks = sample_from_probs(probs, keys)
        assert (probs.gather(1, toks[:, None]) > 0).all(), toks


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs * n
    keep = expected > 0
    return (((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum().item()


def test_exponential_race_draws_follow_the_distribution():
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
    n = 20000
    keys = position_keys(torch.full((n,), 1234), torch.arange(n))
    toks = sample_from_probs(p.expand(n, -1), keys)
    counts = torch.bincount(toks, minlength=8).float()
    # 99.9% quantile of chi-square with 7 degrees of freedom is 24.3.
    assert _chi_square(counts, p) < 24.3
    # A sampler that ignores the tail (a classic bug) is caught by the same statistic.
    wrong = torch.bincount(p[:4].expand(n, -1).multinomial(1).squeeze(1), minlength=8).float()
    assert _chi_square(wrong + 0.0, p) > 24.3


def test_greedy_rows_take_argmax():
    logits = torch.randn(4, 100)
    st = _st(4, temperature=0.0)
    assert torch.equal(sample(logits, st, torch.zeros(4, dtype=torch.int64)), logits.argmax(-1))


def test_top_k_top_p_min_p_exclude_tokens():
    torch.manual_seed(0)
    logits = torch.randn(1, 50) * 3
    order = logits[0].argsort(descending=True)
    probs = torch.softmax(logits[0], -1)
    n = 3000
    pos = torch.arange(n)
    big = logits.expand(n, -1)

    toks = sample(big, _st(n, top_k=5, seeds=torch.full((n,), 9)), pos)
    assert set(toks.tolist()) <= set(order[:5].tolist())
    assert len(set(toks.tolist())) == 5

    top_p = 0.8
    cum = probs[order].cumsum(0)
    k_min = int((cum < top_p).sum().item()) + 1  # smallest prefix with mass >= top_p
    toks = sample(big, _st(n, top_p=top_p, seeds=torch.full((n,), 9)), pos)
    assert set(toks.tolist()) <= set(order[:k_min].tolist())
    filtered = apply_filters(logits, _st(1, top_p=top_p))
    assert (filtered[0] > 0).sum().item() == k_min
    assert math.isclose(filtered.sum().item(), 1.0, rel_tol=1e-5)

    filtered = apply_filters(logits, _st(1, min_p=0.2))
    kept = filtered[0] > 0
    assert torch.equal(kept, probs >= 0.2 * probs.max())


def test_seeded_row_is_independent_of_batch():
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    seeds = torch.tensor([11, 22, 33, 44, 55])
    pos = torch.tensor([3, 9, 4, 4, 100])
    together = sample(logits, _st(5, seeds=seeds), pos)
    for i in range(5):
        alone = sample(logits[i:i + 1], _st(1, seeds=seeds[i:i + 1]), pos[i:i + 1])
        assert alone.item() == together[i].item()
