"""A prompt step's draft pass over each prompt's head, launched before the host waits (issue 16).

After a prompt step the draft's first pass runs over every prompt position, to write the
draft's KV there. The graphed proposal takes the last q positions of each request (a chain's
propose graph k + 1, a tree's first-pass graph its query length); the positions before them,
the head, replay the draft's prompt graphs (engine/draft_prefill_graph.py) through
``EagleProposer.cut_first_pass``. That ran after the host had read the step's tokens, with the
GPU idle behind it: at batch 64 on the H100 (fifty-first session, cProfile of a prompt step)
the head's staging of ~1,500 rows was ~1.6 ms of a 2.3 ms proposal, and an EAGLE engine's
prompt step took ~2x vanilla's.

The head does not depend on the step's sampled tokens: the token after each of its positions
is a prompt token, and its target states are rows of this step's forward. So it runs here,
while the host would otherwise only wait for the GPU: ``ModelRunner.to_host`` issues the
step's device-to-host copy, then calls ``launch``, then waits. By then every read of the
step's logits (argmax, sampling) is queued ahead. ``launch`` first gathers the target rows the
later proposal still reads into tensors of their own (the head's replay may reuse the graph
memory the target's outputs live in, ``capture/cuda_graphs.py``), then writes the head's draft
KV; the proposal then starts each request's first pass where its head ended (``pending``).

Exact by construction: the same positions get the same first pass, only earlier; the draft's
KV at a position depends on the KV before it, which the head writes first in stream order. A
request the proposal later leaves out (finished, no KV room) had draft KV written in its own
blocks: unused, as an early proposal's (engine/early_propose.py).

Taken where the late path would cut a head (a proposer with graphs, a request with no drafts
to verify whose span is longer than q), unless the step verifies drafts and returns logprobs
(they read the logits after the wait; a step without drafts computes them before it) or a head
request still has deferred draft rows (their flush must come first;
engine/deferred_first_pass.py). Those steps cut the head in the proposal as before,
counted in ``PromptHeadStats.late``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from compiled_spec.engine.batch import Span, to_device
from compiled_spec.spec.propose_batch import ProposeBatch

if TYPE_CHECKING:
    from compiled_spec.engine.model_runner import ModelRunner
    from compiled_spec.engine.request import Request


@dataclass
class PromptHeadStats:
    early: int = 0  # prompt steps whose heads were written before the host's wait
    rows: int = 0  # ... the positions they covered
    late: dict[str, int] = field(default_factory=dict)  # prompt steps that cut them late: why

    def as_dict(self) -> dict[str, Any]:
        return {"early": self.early, "rows": self.rows, "late": dict(self.late)}


@dataclass
class HeadPlan:
    """One step's heads: ``cuts[i]`` leading positions of request i (0: none)."""

    reqs: "list[Request]"
    spans: list[Span]
    row_start: list[int]
    cuts: np.ndarray  # [B] int64
    target_hidden: torch.Tensor | list[torch.Tensor]
    # Set by ``launch``: what the proposal reads instead of the step's own
    hidden: torch.Tensor | list[torch.Tensor] | None = None  # [sum of kept rows, ...]
    rest_spans: list[Span] | None = None
    rest_row_start: list[int] | None = None


def concat_ranges(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``firsts[i], firsts[i] + 1, ...`` (``counts[i]`` of them) for each i, concatenated."""
    return np.repeat(firsts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))


class PromptHead:
    def __init__(self, runner: "ModelRunner") -> None:
        self.rn = runner
        self.enabled = True
        self.stats = PromptHeadStats()

    def plan(self, reqs: "list[Request]", spans: list[Span], num_draft: list[int],
             row_start: list[int], target_hidden: torch.Tensor | list[torch.Tensor],
             logprobs: bool) -> HeadPlan | None:
        """The step's heads, or None where it has none or they must wait (counted)."""
        prop = self.rn.proposer
        q = None if prop is None or not self.enabled else prop.prompt_head_rows()
        if q is None:
            return None
        cuts = np.fromiter((s.length - q if k_d == 0 and s.length > q and r.spec_enabled else 0
                            for r, s, k_d in zip(reqs, spans, num_draft)),
                           dtype=np.int64, count=len(reqs))
        if not cuts.any():
            return None
        d = self.rn.deferred
        why = ("logprobs" if logprobs else
               "deferred" if d is not None and d.pending and any(
                   s.req_id in d.pending for s, c in zip(spans, cuts) if c) else None)
        if why is not None:
            self.stats.late[why] = self.stats.late.get(why, 0) + 1
            return None
        return HeadPlan(reqs, spans, row_start, cuts, target_hidden)

    def launch(self, p: HeadPlan) -> None:
        """Gather the rows the proposal reads, then write the heads' draft KV (see above)."""
        spans, cuts = p.spans, p.cuts
        lengths = np.fromiter((s.length for s in spans), dtype=np.int64, count=len(spans))
        starts = np.asarray(p.row_start, dtype=np.int64)  # [B] each request's first row
        keep = lengths - cuts  # [B] rows the proposal reads per request
        idx_t = to_device(concat_ranges(starts + cuts, keep), self.rn.device)
        th = p.target_hidden
        p.hidden = ([h.index_select(0, idx_t) for h in th] if isinstance(th, list)
                    else th.index_select(0, idx_t))  # [sum(keep), width] each
        cut_at = np.flatnonzero(cuts)  # requests with a head
        head = [Span(spans[i].req_id, spans[i].start, int(cuts[i])) for i in cut_at]
        ids = np.fromiter(chain.from_iterable(
            p.reqs[i].tokens(s.start + 1, s.start + 1 + s.length) for i, s in zip(cut_at, head)),
            dtype=np.int64, count=int(cuts.sum()))
        rows = concat_ranges(starts[cut_at], cuts[cut_at])  # the heads' target rows
        batch = ProposeBatch(first_pass=head, token_ids=ids, hidden_rows=rows, step_limits=[],
                             temperature=[], seeds=[])
        self.rn.proposer.write_head(batch, th)
        p.rest_spans = [Span(s.req_id, s.start + int(c), s.length - int(c))
                        for s, c in zip(spans, cuts)]
        p.rest_row_start = (np.cumsum(keep) - keep).tolist()
        self.stats.early += 1
        self.stats.rows += int(cuts.sum())
