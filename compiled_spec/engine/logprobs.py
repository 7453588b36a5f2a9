"""Per-token log-probabilities (``SamplingParams(logprobs=k)``): for each emitted token, its
log-probability and the ``k`` most likely tokens' under the target's distribution at that
position (the model's logits, before temperature and top-k/p/min-p, as vLLM returns by default).

Speculation stays exact: an accepted draft's distribution is the verify forward's row at its
position, the same distribution vanilla decoding samples that token from. Only requests that
ask for logprobs cost anything: one log_softmax over their rows and one more copy to the host.
"""
from __future__ import annotations

import torch

from compiled_spec.sampling_params import LOGPROBS_MAX  # noqa: F401 - the bound, re-exported

TokenLogprobs = dict[int, float]  # token id -> log-probability; the emitted token always in it


def gather_logprobs(rows: list[torch.Tensor | None], tokens: list[list[int]],
                    ks: list[int | None]) -> list[list[TokenLogprobs] | None]:
    """``rows[b]`` [n_b, V] target logits of request b's emitted ``tokens[b]`` (n_b of them),
    None where the request asked for none (``ks[b] is None``)."""
    want = [b for b, k in enumerate(ks) if k is not None]
    out: list[list[TokenLogprobs] | None] = [None] * len(rows)
    if not want:
        return out
    kmax = max(ks[b] for b in want)
    logits = torch.cat([rows[b][:len(tokens[b])] for b in want]).float()
    lp = torch.log_softmax(logits, dim=-1)
    idx = torch.tensor([t for b in want for t in tokens[b]], device=lp.device)
    chosen = lp.gather(1, idx[:, None])[:, 0]
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax > 0 else (lp[:, :0], idx[:, None][:, :0])
    chosen_l, top_vl, top_il = chosen.tolist(), top_v.tolist(), top_i.tolist()
    r = 0
    for b in want:
        per_tok = []
        for t in tokens[b]:
            d = {int(i): float(v) for i, v in zip(top_il[r][:ks[b]], top_vl[r][:ks[b]])}
            d[t] = chosen_l[r]
            per_tok.append(d)
            r += 1
        out[b] = per_tok
    return out
