"""A late step's acceptance when some request samples (temperature > 0): rejection sampling of
the verified drafts against the target's filtered distribution, on the device, with the
step's one device-to-host copy of the results (``ModelRunner._accept``'s sampled branch)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from compiled_spec.engine.batch import build_sampling_tensors, to_device
from compiled_spec.engine.request import Request
from compiled_spec.sampler import apply_filters
from compiled_spec.spec.rejection import accept_coupled, coupled_tokens, rejection_sample

if TYPE_CHECKING:
    from compiled_spec.engine.model_runner import ModelRunner


def sampled_accept(rn: "ModelRunner", reqs: list[Request],
                   logits: torch.Tensor,  # [B, K+1, V]
                   num_draft: list[int]) -> list[list[int]]:
    """Per request: its accepted drafts, then the token sampled after them."""
    kmax = logits.shape[1] - 1
    k_t = to_device(num_draft, rn.device)  # [B]
    drafts, q = _last_proposal(rn, reqs, kmax)
    if q is None:  # argmax drafts: the coupling rule on the slots' draws (replayed if captured)
        out, n_acc = accept_coupled(coupled_targets(rn, reqs, logits), drafts, k_t)
    else:
        probs, seeds, positions0 = _target_probs(rn, reqs, logits)
        out, n_acc = rejection_sample(probs, drafts, k_t, seeds, positions0, q)
    packed = rn.to_host(torch.cat([n_acc[:, None], out], dim=1))  # the step's one D2H copy
    return [row[1:2 + row[0]] for row in packed]


def coupled_targets(rn: "ModelRunner", reqs: list[Request],
                    logits: torch.Tensor,  # [B, K+1, V]
                    ) -> torch.Tensor:  # [B, K+1]
    """The token vanilla sampling would draw at each verified slot of each request (the
    coupling rule, ``spec.rejection.coupled_tokens``; greedy rows: the argmax). For one-hot
    drafts it stands where a greedy step's argmax does: a decode step's token, an early step's
    acceptance input. The same ops as ``sampled_accept``'s, so the tokens are the same; one
    graph replay of them where the engine captured one (engine/sample_graph.py)."""
    if rn.sample_graph is not None:
        drawn = rn.sample_graph.draw(reqs, logits)  # None (counted): no graph takes it
        if drawn is not None:
            return drawn
    return coupled_tokens(*_target_probs(rn, reqs, logits))


def _target_probs(rn: "ModelRunner", reqs: list[Request],
                  logits: torch.Tensor,  # [B, K+1, V]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The filtered target distributions [B, K+1, V] (fp32), each request's seed [B] and the
    position of its slot 0 [B] (the token after its last one)."""
    B, K1, V = logits.shape
    st = build_sampling_tensors(reqs, rn.device, repeat=K1)
    probs = apply_filters(logits.reshape(B * K1, V), st).view(B, K1, V)
    positions0 = to_device([r.num_tokens for r in reqs], rn.device)
    return probs, st.seeds.view(B, K1)[:, 0], positions0


def _last_proposal(rn: "ModelRunner", reqs: list[Request], kmax: int
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each request's row of the last proposal: drafts [B, kmax] and, when drafts were sampled,
    their probabilities [B, kmax, V] (else None)."""
    if kmax == 0:
        return torch.zeros((len(reqs), 0), dtype=torch.int64, device=rn.device), None
    idx = to_device([rn._draft_row.get(r.req_id, 0) for r in reqs], rn.device)
    q = None if rn._draft_probs is None else rn._draft_probs[idx, :kmax]
    return rn._drafts[idx, :kmax], q
