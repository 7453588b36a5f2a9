"""A proposal after a prompt step, through the propose graph: the first pass split in two.

The captured propose graph takes at most k + 1 first-pass positions per request; a request
whose prompt was just computed has its whole prompt there, so every proposal of a step with a
prompt ran uncaptured (H200, SmolLM2: 8.6 ms of host time after a 53-token prompt at batch 1,
the draft's first pass then four eager loop steps, against ~0.3 ms for a replay). The draft
layer's KV at a position depends only on that position's target state and next token, and each
first-pass row attends to the draft KV at or before it, so the first pass over positions
[s, s + m) equals a pass over [s, s + m - q) (its KV written, its outputs unused) followed by a
pass over the last q positions: that second part is an ordinary graph-sized proposal.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from compiled_spec.engine.batch import Span, to_device
from compiled_spec.spec.propose_batch import ProposeBatch


def split_first_pass(batch: ProposeBatch, q: int) -> tuple[ProposeBatch | None, ProposeBatch]:
    """(the leading positions of every first pass longer than ``q`` as a batch of their own,
    None when there are none; ``batch`` with each first pass cut to its last ``q`` positions).
    Both keep the target rows of ``batch`` (``hidden_rows`` index the same target states)."""
    # Every late proposal comes through here, a prompt in it or not: without one nothing is
    # cut, and the lists below cost ~90 us at batch 64 (CPU) for nothing.
    if all(s.length <= q for s in batch.first_pass):
        return None, batch
    pre_spans, pre_ids, pre_rows = [], [], []
    spans, ids, rows = [], [], []
    o = 0
    for s in batch.first_pass:
        cut = max(0, s.length - q)
        if cut:
            pre_spans.append(Span(s.req_id, s.start, cut))
            pre_ids += batch.token_ids[o:o + cut]
            pre_rows += batch.hidden_rows[o:o + cut]
        spans.append(Span(s.req_id, s.start + cut, s.length - cut))
        ids += batch.token_ids[o + cut:o + s.length]
        rows += batch.hidden_rows[o + cut:o + s.length]
        o += s.length
    if not pre_spans:
        return None, batch
    pre = ProposeBatch(first_pass=pre_spans, token_ids=pre_ids, hidden_rows=pre_rows,
                       step_limits=[], temperature=[], seeds=[])
    rest = ProposeBatch(first_pass=spans, token_ids=ids, hidden_rows=rows,
                        step_limits=batch.step_limits, temperature=batch.temperature,
                        seeds=batch.seeds)
    return pre, rest


def compact_rows(batch: ProposeBatch, target_hidden: torch.Tensor | list[torch.Tensor],
                 device: torch.device
                 ) -> tuple[ProposeBatch, torch.Tensor | list[torch.Tensor]]:
    """``batch`` reading only the target rows it uses, gathered into new tensors (EAGLE-3: one
    per aux layer; EAGLE-1: the final hidden) and numbered 0, 1, ...: the propose graph's
    hidden buffer holds a verify step's rows, not a prompt's."""
    idx = to_device(batch.hidden_rows, device)
    rows = replace(batch, hidden_rows=list(range(len(batch.hidden_rows))))
    if isinstance(target_hidden, list):
        return rows, [h[idx] for h in target_hidden]  # [T_used, h_target] each
    return rows, target_hidden[idx]
