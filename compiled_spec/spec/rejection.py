"""Speculative rejection sampling (Leviathan et al., arXiv 2211.17192), vectorised on device.

Everything is whole-batch tensor ops: no host syncs (.item(), .tolist(), .nonzero(), boolean-mask
indexing) and no Python loop over rows, so one verification step stays capturable by CUDA graphs
and traceable by torch.compile(fullgraph=True). Per-row early stopping ("stop at the first
rejection") is expressed as a cumulative product over the accept mask instead of a loop.

All randomness is counter-based (compiled_spec.sampler): a draw depends only on (request seed,
absolute token position, stream). Streams used here:
  STREAM_TOKEN  (0): the noise that picks the emitted token at a position (same as vanilla decoding),
  STREAM_ACCEPT (1): the uniform of the accept test for a sampled draft,
  STREAM_DRAFT  (2): the noise the drafter uses to sample a draft token (sample_draft).
Distinct streams make the draft, the accept test and the recovered token independent, which the
exactness argument of rejection sampling needs.
"""
from __future__ import annotations

import torch

from compiled_spec.sampler import (STREAM_ACCEPT, STREAM_TOKEN, position_keys, sample_from_probs,
                                   uniform_noise)

STREAM_DRAFT = 2  # noise stream for drafting by sampling; independent of STREAM_TOKEN/ACCEPT

__all__ = ["STREAM_DRAFT", "accept_coupled", "coupled_tokens", "rejection_sample",
           "sample_draft"]


def sample_draft(draft_probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Sample one draft token per row from the draft distribution q.

    draft_probs [B, V] (filtered, like the target), seeds [B], positions [B] = absolute position of
    the token being drafted (draft j of a chain sits at the verification slot position + j)
    -> [B] int64. Uses STREAM_DRAFT so the draft is independent of the accept uniform and of the
    recovered-token noise drawn later at the same position.
    """
    return sample_from_probs(draft_probs, position_keys(seeds, positions, STREAM_DRAFT))


def _slot_keys(seeds: torch.Tensor, positions: torch.Tensor, num_slots: int, stream: int) -> torch.Tensor:
    """[B] seeds, [B] positions -> [B * num_slots] keys, slot j at position positions + j (row-major)."""
    slots = torch.arange(num_slots, device=positions.device, dtype=torch.int64)
    pos = positions[:, None] + slots[None, :]  # [B, S]
    return position_keys(seeds[:, None], pos, stream).reshape(-1)  # elementwise hash, broadcasts


def coupled_tokens(target_probs: torch.Tensor, seeds: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """The coupling rule's draws (see ``rejection_sample``): at every slot j the token vanilla
    sampling would draw there, t_j = draw(p_j, key(seed, position + j, STREAM_TOKEN)).

    target_probs [B, K+1, V] (greedy rows one-hot: t is their argmax), seeds [B], positions [B]
    (slot 0's absolute position) -> [B, K+1] int64. With one-hot drafts, "accept while d_j ==
    t_j, then emit t" is the whole verification: the early paths write t where they write a
    greedy step's argmax, and their graphs and the host then agree with the late path."""
    bsz, kp1, vocab = target_probs.shape
    keys = _slot_keys(seeds, positions, kp1, STREAM_TOKEN)  # [B*(K+1)]
    return sample_from_probs(target_probs.reshape(bsz * kp1, vocab), keys).view(bsz, kp1)


def accept_coupled(t: torch.Tensor, draft_tokens: torch.Tensor, num_draft: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The coupling rule's acceptance (``rejection_sample`` with one-hot drafts) from its draws
    ``t`` [B, K+1] (``coupled_tokens``, or the same draws replayed by a graph): accept draft j
    while it equals t_j, then emit t. draft_tokens [B, K], num_draft [B] -> (output tokens
    [B, K+1] with -1 padding, num_accepted [B])."""
    k = draft_tokens.shape[1]
    slot = torch.arange(k + 1, device=t.device, dtype=torch.int64)[None, :]  # [1, K+1]
    in_range = slot[:, :k] < num_draft[:, None]  # [B, K]: drafts beyond k_i are padding
    accept = (draft_tokens == t[:, :k]) & in_range  # [B, K] (padding never counts)
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]: length of accepted prefix
    # Accepted drafts equal t, so the whole valid prefix of the row is t itself.
    out = torch.where(slot <= num_accepted[:, None], t, torch.full_like(t, -1))
    return out, num_accepted


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify chain drafts against the target and emit the tokens of one speculative step.

    target_probs [B, K+1, V] fp32: filtered target distributions (greedy rows one-hot); slot j
        is the distribution of the token at absolute position positions + j.
    draft_tokens [B, K] int64: draft ids in target vocabulary; only the first num_draft[i] count.
    num_draft    [B] int64: k_i in [0, K].
    seeds        [B] int64: per-request seeds.
    positions    [B] int64: absolute position of the token sampled at slot 0.
    draft_probs  [B, K, V] fp32 or None: the draft distributions q the drafts were sampled from
        (sample_draft); None means argmax / one-hot drafts.

    Returns (output_tokens [B, K+1] int64, num_accepted [B] int64). Row i holds its accepted drafts,
    then one recovered (first rejection) or bonus (all k_i accepted) token, then -1 padding, so
    num_accepted[i] + 1 tokens are valid.
    """
    bsz, kp1, vocab = target_probs.shape
    k = kp1 - 1
    slot = torch.arange(kp1, device=target_probs.device, dtype=torch.int64)[None, :]  # [1, K+1]
    in_range = slot[:, :k] < num_draft[:, None]  # [B, K]: drafts beyond k_i are padding
    # Padding drafts may hold anything (e.g. -1); clamp so gathers stay in bounds (they are masked).
    drafts = draft_tokens.clamp(0, vocab - 1)  # [B, K]

    if draft_probs is None or k == 0:
        # Coupling rule for one-hot drafts. At every slot draw the token vanilla decoding would
        # draw there, t_j = draw(p_j, key(seed, position + j, STREAM_TOKEN)), accept draft j iff
        # d_j == t_j, and emit t_j at the first mismatch (or as the bonus).
        # Why exact: with q = one-hot(d), Leviathan accepts with prob min(1, p(d)/q(d)) = p(d) =
        # P(t_j == d); on rejection he samples normalize(max(p - q, 0)) = p with d removed and
        # renormalised, which is exactly the law of t_j given t_j != d. Each t_j uses its own
        # position's noise, so the slots are independent as the chain requires.
        # Why it is also reproducible: every emitted token (accepted draft or recovered/bonus) is
        # t_j, and p_j depends only on the already-emitted prefix, so the output equals vanilla
        # sampling with the same seed token for token, whatever K or the draft quality is.
        # Greedy rows have one-hot p_j, so t_j = argmax and this is "accept while equal to argmax".
        return accept_coupled(coupled_tokens(target_probs, seeds, positions), drafts,
                              num_draft)

    # Sampled drafts: accept d_j iff u_j < min(1, p(d_j) / q(d_j)), written as u * q < p to avoid
    # dividing by q (u < 1, so the min(1, .) is implicit). Greedy rows: p(d) is 1 for the argmax and
    # 0 otherwise, so this accepts exactly while d_j == argmax (0 < 0 is false).
    p_d = target_probs[:, :k].gather(2, drafts[..., None]).squeeze(-1)  # [B, K]
    q_d = draft_probs.gather(2, drafts[..., None]).squeeze(-1)  # [B, K]
    u = uniform_noise(_slot_keys(seeds, positions, k, STREAM_ACCEPT), 1)[:, 0].view(bsz, k)  # [B, K]
    accept = (u * q_d < p_d) & in_range  # [B, K]
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [B]

    # Only slot n = num_accepted emits a sampled token, so gather that one distribution per row
    # instead of racing all K+1 slots. If n < k_i it is a rejection: recovered ~ normalize(max(p - q,
    # 0)); if n == k_i it is the bonus ~ p, which is the same formula with q zeroed.
    n = num_accepted  # [B]
    p_n = target_probs.gather(1, n[:, None, None].expand(bsz, 1, vocab)).squeeze(1)  # [B, V]
    q_idx = n.clamp(max=k - 1)[:, None, None].expand(bsz, 1, vocab)  # n == K only for the bonus
    q_n = draft_probs.gather(1, q_idx).squeeze(1)  # [B, V]
    rejected = (n < num_draft).to(q_n.dtype)[:, None]  # [B, 1]
    residual = (p_n - q_n * rejected).clamp_min(0.0)  # [B, V]; the draw needs no normalisation
    # p <= q everywhere (p == q up to rounding) leaves no mass: fall back to p. Greedy rows keep
    # mass 1 - q(argmax) > 0 on the argmax only (or fall back to the one-hot p), so recovered = argmax.
    has_mass = residual.sum(dim=-1, keepdim=True) > 0  # [B, 1]
    dist = torch.where(has_mass, residual, p_n)  # [B, V]
    # STREAM_TOKEN at the emitted position, like vanilla: the bonus token equals the vanilla draw.
    tok = sample_from_probs(dist, position_keys(seeds, positions + n, STREAM_TOKEN))  # [B]

    drafts_pad = torch.cat([draft_tokens, draft_tokens.new_zeros(bsz, 1)], dim=1)  # [B, K+1]
    nn = n[:, None]  # [B, 1]
    out = torch.where(slot < nn, drafts_pad, torch.where(slot == nn, tok[:, None], -1))  # [B, K+1]
    return out, num_accepted
