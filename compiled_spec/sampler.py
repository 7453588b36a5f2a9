"""On-device sampling: greedy, temperature, top-k, top-p and min-p, with counter-based noise.

Random draws are a hash of (request seed, token position, stream) computed with integer tensor
ops, instead of a stateful generator per request: one uniform per row, turned into a token by
inverse-CDF sampling. So a seeded request gives the
same tokens whatever else is in the batch, the whole step stays on device (no per-row generator
loop, nothing a CUDA graph could not capture), and a later speculative step that samples position
n draws exactly the noise vanilla decoding draws at position n.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**27, so products of 32-bit values stay below 2**59 in int64
_GOLDEN = 0x9E3779B1

# Independent noise streams drawn at the same position.
STREAM_TOKEN = 0  # Gumbel/exponential noise for sampling a token
STREAM_ACCEPT = 1  # uniform for speculative acceptance tests


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser on int64 tensors holding values in [0, 2**32)."""
    x = (((x >> 16) ^ x) * _MUL) & _M32
    x = (((x >> 16) ^ x) * _MUL) & _M32
    return (x >> 16) ^ x


def position_keys(seeds: torch.Tensor, positions: torch.Tensor, stream: int = STREAM_TOKEN) -> torch.Tensor:
    """[B] int64 seeds and positions -> [B] int64 keys in [0, 2**32)."""
    lo = seeds & _M32
    hi = (seeds >> 32) & _M32
    k = _mix32(lo ^ _mix32(hi + stream * 0x3C6EF372 & _M32))
    return _mix32((k + positions * _GOLDEN) & _M32)


def bits_to_unit(h: torch.Tensor) -> torch.Tensor:
    """int64 hashes in [0, 2**32) -> float32 uniforms strictly inside (0, 1).

    23 bits, not 24: (2**24 - 0.5) / 2**24 is not a float32 and rounds to exactly 1.0, whose
    -log is 0, so an exponential race would divide by zero and pick a token of probability 0.
    Every (m + 0.5) / 2**23 with m < 2**23 is exact in float32's 24-bit significand.
    """
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def uniform_noise(keys: torch.Tensor, width: int) -> torch.Tensor:
    """[B] keys -> [B, width] uniforms in (0, 1), one per vocabulary index."""
    idx = torch.arange(width, device=keys.device, dtype=torch.int64)
    h = _mix32((keys[:, None] ^ ((idx[None, :] * _GOLDEN) & _M32)) + 0x6A09E667 & _M32)
    h = _mix32(h ^ keys[:, None])
    return bits_to_unit(h)


@dataclass
class SamplingTensors:
    """Per-row sampling parameters for one batch, on the model's device."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32
    min_p: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    all_greedy: bool  # host-known flags let us skip work without a device sync
    any_sorting: bool
    any_min_p: bool


def apply_filters(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """[B, V] raw logits -> [B, V] target probabilities after temperature, top-k, top-p, min-p.

    Greedy rows get a one-hot distribution on their argmax, so callers can treat all rows alike.
    """
    logits = logits.float()
    greedy = st.temperature == 0  # [B]
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    scaled = logits / temp[:, None]
    if st.any_sorting:
        sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)  # [B, V]
        vocab = logits.shape[-1]
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, vocab))
        drop = ranks >= k[:, None]
        sorted_probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it
        # already reaches top_p (the top token always survives).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = drop | (mass_before >= st.top_p[:, None])
        drop_orig = torch.zeros_like(drop).scatter_(1, sorted_idx, drop)
        scaled = scaled.masked_fill(drop_orig, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if st.any_min_p:
        floor = st.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def row_uniform(keys: torch.Tensor) -> torch.Tensor:
    """[B] keys -> [B] float64 uniforms in (0, 1) with 46 random bits (two hashes of the key),
    fine enough that inverse-CDF sampling resolves probabilities far below 1e-7."""
    hi = _mix32((keys + 0x1B873593) & _M32) >> 9  # [B] 23 bits
    lo = _mix32((keys ^ 0x5BD1E995) & _M32) >> 9
    return (hi.double() * (1 << 23) + lo.double() + 0.5) * (1.0 / (1 << 46))


def sample_from_probs(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: the first index whose cumulative weight exceeds u * total, with one
    uniform u per row, is an exact draw from probs / total.

    probs [B, V] non-negative weights (need not sum to 1), keys [B] -> [B] int64. One-hot rows
    return their hot index and zero-weight tokens are never drawn (the CDF is flat there).
    One hash per row instead of one per vocabulary entry (an exponential race over [B, V]
    hashes cost ~80% of a batch-512 sampling step); float64 sums keep the CDF exact to ~1e-12
    over a 128k vocabulary.
    """
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    target = row_uniform(keys) * cdf[:, -1]  # [B], strictly inside (0, total)
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # [B]
    return idx.clamp(max=probs.shape[-1] - 1)


def sample(logits: torch.Tensor, st: SamplingTensors, positions: torch.Tensor) -> torch.Tensor:
    """[B, V] logits and the [B] positions of the tokens being sampled -> [B] int64 token ids."""
    if st.all_greedy:
        return logits.argmax(dim=-1)
    probs = apply_filters(logits, st)
    return sample_from_probs(probs, position_keys(st.seeds, positions))
