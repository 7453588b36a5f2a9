"""Speculative decoding through the engine: lossless against vanilla decoding, exact sampling,
seeds, the max_model_len edge, requests that opt out, and the acceptance metrics."""
from collections import Counter

import pytest
import torch

from compiled_spec import LLM, SamplingParams
from tests.spec_models import write_bigram_target, write_mirror_eagle1

PROMPTS = [[3, 17, 5, 9, 22, 1, 8], [7], list(range(1, 30)), [11, 12], [30], [2, 4], [19, 6, 27], [15]]


@pytest.fixture(scope="module")
def bigram(tmp_path_factory):
    root = tmp_path_factory.mktemp("bigram")
    target = write_bigram_target(root / "target", layers=2)
    return {
        "target": target,
        "mirror": write_mirror_eagle1(root / "mirror", target),
        "noisy": write_mirror_eagle1(root / "noisy", target, noise=0.2),
    }


@pytest.fixture(scope="module")
def bigram_one_layer(tmp_path_factory):
    root = tmp_path_factory.mktemp("bigram1")
    target = write_bigram_target(root / "target", layers=1, seed=3)
    return {"target": target, "mirror": write_mirror_eagle1(root / "mirror", target)}


def _llm(target, tok, **kw):
    kw.setdefault("max_model_len", 128)
    return LLM(model=target, tokenizer=tok, **kw)


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def vanilla_greedy(bigram, smollm2_gguf_path):
    return [o.token_ids for o in _llm(bigram["target"], smollm2_gguf_path).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_lossless_mirror_head(bigram, smollm2_gguf_path, vanilla_greedy, k, page_size):
    llm = _llm(bigram["target"], smollm2_gguf_path, draft=bigram["mirror"],
               num_speculative_tokens=k, page_size=page_size)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == vanilla_greedy
    spec = llm.stats.spec
    # The mirror head always agrees: every step accepts all it drafted.
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    assert spec.mean_acceptance_length > 1 + 0.8 * k
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_greedy_lossless_one_layer_draft(bigram_one_layer, smollm2_gguf_path):
    pair = bigram_one_layer
    vanilla = [o.token_ids for o in _llm(pair["target"], smollm2_gguf_path).generate(PROMPTS, GREEDY)]
    llm = _llm(pair["target"], smollm2_gguf_path, draft=pair["mirror"], num_speculative_tokens=4)
    assert llm.engine.draft.config.num_hidden_layers == 1
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == vanilla
    assert llm.stats.spec.num_accepted_tokens == llm.stats.spec.num_draft_tokens > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_lossless_partial_agreement(bigram, smollm2_gguf_path, vanilla_greedy, k):
    llm = _llm(bigram["target"], smollm2_gguf_path, draft=bigram["noisy"], num_speculative_tokens=k,
               page_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == vanilla_greedy
    spec = llm.stats.spec
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # both paths exercised
    # Per-request stats add up to the run's.
    assert sum(o.spec_stats.num_accepted_tokens for o in outs) == spec.num_accepted_tokens
    assert sum(o.spec_stats.num_drafting_steps for o in outs) == spec.num_drafting_steps


def test_seeded_sampling_same_as_vanilla_for_any_k_and_batch(bigram, smollm2_gguf_path):
    sp = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    vanilla = [o.token_ids for o in _llm(bigram["target"], smollm2_gguf_path).generate(PROMPTS, sp)]
    for k in (1, 4):
        llm = _llm(bigram["target"], smollm2_gguf_path, draft=bigram["noisy"], num_speculative_tokens=k)
        assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == vanilla
        alone = [llm.generate([p], sp)[0].token_ids for p in PROMPTS]
        assert alone == vanilla


def test_sampled_drafts_reproducible_and_batch_independent(bigram, smollm2_gguf_path):
    sp = SamplingParams(max_tokens=25, temperature=1.0, seed=9, ignore_eos=True)
    llm = _llm(bigram["target"], smollm2_gguf_path, draft=bigram["noisy"], num_speculative_tokens=3,
               draft_sampling="sample")
    together = [o.token_ids for o in llm.generate(PROMPTS, sp)]
    alone = [llm.generate([p], sp)[0].token_ids for p in PROMPTS]
    assert together == alone
    assert llm.stats.spec.num_accepted_tokens > 0


def test_max_model_len_edge_shrinks_k(bigram, smollm2_gguf_path):
    llm = _llm(bigram["target"], smollm2_gguf_path, draft=bigram["mirror"], num_speculative_tokens=5,
               max_model_len=40, page_size=1)
    prompt = list(range(1, 31))
    out = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    ref = _llm(bigram["target"], smollm2_gguf_path, max_model_len=40).generate(
        [prompt], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == ref.token_ids and len(out.token_ids) == 10
    assert out.finish_reason == "length"
    # No block beyond what 40 positions need was ever handed out, and all came back.
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_requests_that_opt_out_decode_plainly_in_the_same_batch(bigram, smollm2_gguf_path, vanilla_greedy):
    llm = _llm(bigram["target"], smollm2_gguf_path, draft=bigram["mirror"], num_speculative_tokens=3)
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, speculate=False)
    outs = llm.generate(PROMPTS, [GREEDY, plain] * 4)
    assert [o.token_ids for o in outs] == vanilla_greedy
    assert llm.stats.num_requests_without_speculation == 4
    assert outs[1].spec_stats.num_drafting_steps == 0 and outs[0].spec_stats.num_drafting_steps > 0


def _target_next_probs(llm, temperature):
    """Exact next-token distribution of the bigram target for every current token: [V, V]."""
    m = llm.engine.model
    V = m.config.vocab_size
    with torch.no_grad():
        h = m.model.embed_tokens.weight  # [V, h]
        for layer in m.model.layers:
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return torch.softmax(m.compute_logits(m.model.norm(h)) / temperature, dim=-1)


@pytest.mark.parametrize("draft_sampling", ["argmax", "sample"])
def test_speculative_samples_follow_the_target_distribution(bigram, smollm2_gguf_path, draft_sampling,
                                                             monkeypatch):
    llm = _llm(bigram["target"], smollm2_gguf_path, draft=bigram["noisy"], num_speculative_tokens=3,
               draft_sampling=draft_sampling, max_num_seqs=512, max_model_len=16)
    P = _target_next_probs(llm, 1.0)  # [V, V]
    n, prompt = 3000, [5]
    sps = [SamplingParams(max_tokens=4, temperature=1.0, seed=s, ignore_eos=True) for s in range(n)]

    def chi2_third_token(outs) -> float:
        # Tokens 1..3 of each output: the 3rd was produced by verification after drafting.
        dist = P[prompt[-1]] @ P @ P  # exact marginal of the 3rd generated token, [V]
        counts = Counter(o.token_ids[2] for o in outs)
        obs = torch.tensor([counts.get(v, 0) for v in range(P.shape[0])], dtype=torch.float64)
        exp = dist.double() * n
        keep = exp > 5
        rest_obs, rest_exp = obs[~keep].sum(), exp[~keep].sum()
        stat = (((obs[keep] - exp[keep]) ** 2) / exp[keep]).sum()
        if rest_exp > 0:
            stat += (rest_obs - rest_exp) ** 2 / rest_exp
        return stat.item(), int(keep.sum().item())

    outs = llm.generate([prompt] * n, sps)
    assert llm.stats.spec.num_accepted_tokens > 0
    stat, df = chi2_third_token(outs)
    assert stat < df + 4.5 * (2 * df) ** 0.5, f"chi2 {stat:.1f} with {df} cells"

    # The same test catches a sampler that emits the draft's guess more often than it should
    # (recovering from p instead of normalize(max(p - q, 0))). Argmax drafts are accepted
    # from the coupled draws (accept_coupled), sampled ones by Leviathan's rule.
    import compiled_spec.engine.sampled_accept as mr

    name = "accept_coupled" if draft_sampling == "argmax" else "rejection_sample"
    real = getattr(mr, name)

    def broken(*args, **kw):
        # Accept the first draft unconditionally: the textbook bug of skipping the test at slot 0.
        out, acc = real(*args, **kw)
        draft_tokens, num_draft = args[1:3]  # (t or target_probs, drafts, num_draft, ...)
        if draft_tokens.shape[1]:
            out = out.clone()
            out[:, 0] = torch.where(num_draft > 0, draft_tokens[:, 0], out[:, 0])
        return out, acc

    monkeypatch.setattr(mr, name, broken)
    bad = _llm(bigram["target"], smollm2_gguf_path, draft=bigram["noisy"], num_speculative_tokens=3,
               draft_sampling=draft_sampling, max_num_seqs=512, max_model_len=16)
    stat_bad, df_bad = chi2_third_token(bad.generate([prompt] * n, sps))
    assert stat_bad > df_bad + 4.5 * (2 * df_bad) ** 0.5, f"broken sampler passed: chi2 {stat_bad:.1f}"


@pytest.mark.parametrize("k,page_size", [(1, 16), (3, 1), (5, 16)])
def test_greedy_lossless_trained_eagle3(trained_eagle3_pair, smollm2_gguf_path, k, page_size):
    """An EAGLE-3 head that agrees often (trained for seconds on the bigram target)."""
    target, head = trained_eagle3_pair
    vanilla = [o.token_ids for o in _llm(target, smollm2_gguf_path).generate(PROMPTS, GREEDY)]
    llm = _llm(target, smollm2_gguf_path, draft=head, num_speculative_tokens=k, page_size=page_size)
    assert llm.engine.draft.config.method == "eagle3"
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == vanilla
    spec = llm.stats.spec
    assert spec.mean_acceptance_length > 1 + 0.5 * k
    assert spec.num_accepted_tokens < spec.num_draft_tokens or k == 1
