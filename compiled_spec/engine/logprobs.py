"""Per-token log-probabilities (``SamplingParams(logprobs=k)``): for each emitted token, its
log-probability and the ``k`` most likely tokens' under the target's distribution at that
position (the model's logits, before temperature and top-k/p/min-p, as vLLM returns by default).

Speculation stays exact: an accepted draft's distribution is the verify forward's row at its
position, the same distribution vanilla decoding samples that token from. Only requests that
ask for logprobs cost anything: one log_softmax over their rows and one more copy to the host.
"""
from __future__ import annotations

import numpy as np
import torch

from compiled_spec.sampling_params import LOGPROBS_MAX  # noqa: F401 - the bound, re-exported

TokenLogprobs = dict[int, float]  # token id -> log-probability; the emitted token always in it


def device_logprobs(logits: torch.Tensor,  # [R, V] target logits (any float dtype)
                    tokens: torch.Tensor,  # [R] the token emitted at each row
                    kmax: int) -> torch.Tensor:  # [R, 1 + 2 * kmax] float64
    """Per row: the token's log-probability, then the ``kmax`` largest log-probabilities and
    their ids, in one float64 tensor (ids below 2**53 are exact) so that one copy brings them
    to the host. On the device, before anything reads the tokens: an early step computes them
    before its next launch overwrites the logits (graph memory)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    chosen = lp.gather(1, tokens.long()[:, None])  # [R, 1]
    if kmax == 0:
        return chosen.double()
    top_v, top_i = lp.topk(kmax, dim=-1)  # [R, kmax] each
    return torch.cat([chosen.double(), top_v.double(), top_i.double()], dim=1)


def unpack_logprobs(packed: np.ndarray,  # [R, 1 + 2 * kmax] from ``device_logprobs``
                    rows: list[list[int]],  # per request: its tokens' rows in ``packed``
                    tokens: list[list[int]], ks: list[int | None]
                    ) -> list[list[TokenLogprobs] | None]:
    """The dicts of each request's emitted ``tokens`` (None where ``ks[b]`` is None)."""
    kmax = (packed.shape[1] - 1) // 2
    out: list[list[TokenLogprobs] | None] = [None] * len(ks)
    for b, k in enumerate(ks):
        if k is None:
            continue
        per_tok = []
        for r, t in zip(rows[b], tokens[b]):
            row = packed[r]
            d = {int(i): float(v) for i, v in zip(row[1 + kmax:1 + kmax + k], row[1:1 + k])}
            d[t] = float(row[0])
            per_tok.append(d)
        out[b] = per_tok
    return out


def gather_logprobs(rows: list[torch.Tensor | None], tokens: list[list[int]],
                    ks: list[int | None]) -> list[list[TokenLogprobs] | None]:
    """``rows[b]`` [n_b, V] target logits of request b's emitted ``tokens[b]`` (n_b of them),
    None where the request asked for none (``ks[b] is None``)."""
    want = [b for b, k in enumerate(ks) if k is not None]
    if not want:
        return [None] * len(rows)
    kmax = max(ks[b] for b in want)
    logits = torch.cat([rows[b][:len(tokens[b])] for b in want])  # [R, V]
    idx = torch.tensor([t for b in want for t in tokens[b]], device=logits.device)
    packed = device_logprobs(logits, idx, kmax).cpu().numpy()  # one copy
    at, r = [[] for _ in ks], 0
    for b in want:
        at[b] = list(range(r, r + len(tokens[b])))
        r += len(tokens[b])
    return unpack_logprobs(packed, at, tokens, ks)
