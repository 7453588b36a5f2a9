"""Early propose (issues 14/16): a chain step launches its next proposal BEFORE the host reads
the step's acceptance, so the draft runs on the GPU while the host does the step's bookkeeping.

Late (the default path before this): verify -> device-to-host copy of the acceptance -> host
bookkeeping (token appends, stop checks) -> stage the proposal -> launch it; the GPU idles from
the copy to that launch. Early: verify -> argmax and the verified drafts into one static buffer
-> their copy to the host, issued without waiting -> the propose graph of
``early_propose_graph`` (it computes the acceptance itself from that buffer) -> only then the
host waits for the copy. The engine's later ``propose`` call only records which requests go on.

A step takes the early path when it is a pure chain step: every request verifies k drafts
(one query token plus k), a captured early graph fits, the adaptive policy (if any)
chose to draft in this step (it decides before the step, see ``LLMEngine._run``) and every
request's KV blocks can be grown for the worst case (all k accepted) now. Any other step runs
the late path unchanged, and ``EarlyProposeStats`` says why: no step falls back silently.
Sampled requests go early too (fifty-third session) where the drafts are argmaxes (the default
``draft_sampling``): their acceptance input is vanilla's draw at each slot, not the argmax
(``accept``); with sampled drafts they run late ("sampled_drafts"). Requests with logprobs go
early too: the step computes every slot's logprobs on the device before its replay.

Requests that finish in an early step had their drafts computed anyway: the drafts are dropped;
their draft-KV writes land in their own blocks, in stream order before anything can reuse them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from compiled_spec.engine.batch import to_device
from compiled_spec.engine.logprobs import TokenLogprobs, device_logprobs, unpack_logprobs
from compiled_spec.engine.request import Request
from compiled_spec.engine.sampled_accept import coupled_targets
from compiled_spec.profile import phase

if TYPE_CHECKING:
    from compiled_spec.engine.early_propose_graph import EarlyProposeGraphs
    from compiled_spec.engine.model_runner import ModelRunner


@dataclass
class EarlyProposeStats:
    early: int = 0  # drafting steps whose proposal launched before the acceptance was read
    late: int = 0  # steps of a speculative engine that ran the late path ...
    late_reasons: dict[str, int] = field(default_factory=dict)  # ... and why

    def as_dict(self) -> dict[str, Any]:
        return {"early": self.early, "late": self.late, "late_reasons": dict(self.late_reasons)}


@dataclass
class EarlyStep:
    """A step whose proposal is launched (or about to be) before its acceptance is read."""

    size: int  # the captured batch size it replays
    index: dict[int, int]  # req_id -> its row in this step (and in the drafts)
    starts: list[int]  # per request: the first verified position (its last token's)
    same_rows: bool  # the last proposal's draft rows are this step's rows, in order
    drafts: torch.Tensor | None = None  # [n, k]
    probs: torch.Tensor | None = None  # [n, k, V] when drafts are sampled


class HostCopy:
    """A device-to-host copy issued without waiting: a pinned destination, an event after it
    (on the CPU the copy is done when issued)."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor,
                 event: "torch.cuda.Event | None") -> None:
        dst.copy_(src.reshape(dst.shape), non_blocking=True)  # (dst flat, or src's shape)
        if event is not None:
            event.record()
        self.dst, self.event = dst, event

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.dst


class EarlyPath:
    """What the chain's and the tree's early paths share: the switch, the counters, the checks
    every early step passes and the worst-case block growth."""

    def __init__(self, runner: Any, enabled: bool = True) -> None:
        self.runner = runner
        self.enabled = enabled  # the switch (SpecConfig.early_propose); off: every step late
        # The engine's adaptive policy chose not to draft in this step (set before each step):
        # such a step proposes late, its draft's first pass alone.
        self.paused = False
        self.stats = EarlyProposeStats()
        self._event = torch.cuda.Event() if runner.device.type == "cuda" else None

    def _late(self, why: str) -> None:
        self.stats.late += 1
        self.stats.late_reasons[why] = self.stats.late_reasons.get(why, 0) + 1
        return None

    @property
    def graph(self) -> Any:
        prop = self.runner.proposer
        return None if prop is None else getattr(prop, "early_graph", None)

    # Whether this path computes a step's logprobs itself (the chain's, before its replay);
    # else a request wanting them sends the step late.
    takes_logprobs = False

    def _size(self, reqs: list[Request], shape_why: str | None) -> int | str:
        """The captured size an early step of ``reqs`` replays, or why it runs late
        (``shape_why``: the path's own reason the step's shape does not fit, checked after
        the switch, the graph and the policy)."""
        if not self.enabled:
            return "off"
        g = self.graph
        if g is None:
            return "no_graph"
        if self.paused:
            return "paused"
        if shape_why is not None:
            return shape_why
        if (not all(q.params.greedy for q in reqs)
                and getattr(self.runner.proposer, "sample_drafts", False)):
            return "sampled_drafts"  # (draft_sampling="sample": Leviathan's rule needs q)
        if not self.takes_logprobs and any(q.params.logprobs is not None for q in reqs):
            return "logprobs"
        size = g.graph_size(len(reqs))
        return "size" if size is None else size


class EarlyPropose(EarlyPath):
    """The runner's early path: ``plan`` (after the verify is launched), ``accept`` (in place of
    ``ModelRunner._accept``), ``finish`` (in place of ``ModelRunner.propose``)."""

    runner: "ModelRunner"
    takes_logprobs = True

    @property
    def graph(self) -> "EarlyProposeGraphs | None":
        return super().graph

    def plan(self, reqs: list[Request], num_new: list[int], num_draft: list[int],
             row_start: list[int]) -> EarlyStep | None:
        """Whether this step proposes early (None: late, the reason counted); if so, its
        blocks are grown for the worst case and the graph's inputs staged and uploaded."""
        r = self.runner
        if r.proposer is None:
            return None
        k = r.k
        # prefill rows, or a request verifying < k drafts (k shrunk by the adaptive policy, or
        # near max_model_len): the early graph stages k + 1 verified rows per request
        size = self._size(reqs, "shrunk" if r._drafts_k < k else
                          "not_chain" if max(num_new) != 1 or min(num_draft) != k else None)
        if isinstance(size, str):
            return self._late(size)
        # Worst case: all k drafts accepted (n_tok = num_tokens + k + 1), then k more
        # positions for the next proposal, as ModelRunner.propose grows them; all requests'
        # blocks or none.
        if not r.allocator.grow_all([(q.req_id, min(q.num_tokens + 2 * k + 1, r._grow_cap(q)))
                                     for q in reqs]):
            return self._late("kv_exhausted")
        # Each request's k + 1 verified positions, staged as if all were accepted.
        req_ids = [q.req_id for q in reqs]
        starts = [q.num_computed for q in reqs]
        draft_rows = [r._draft_row[i] for i in req_ids]
        why = self.graph.stage(size, req_ids, starts, row_start, draft_rows,
                               [q.kv_limit for q in reqs], [q.seed for q in reqs],
                               [q.params.temperature for q in reqs])
        if why is not None:
            return self._late(why)
        return EarlyStep(size=size, index={i: j for j, i in enumerate(req_ids)}, starts=starts,
                         same_rows=draft_rows == list(range(len(reqs))))

    def accept(self, step: EarlyStep, reqs: list[Request],
               logits: torch.Tensor,  # [n, k+1, V] (or [N, ...])
               target_hidden: torch.Tensor | list[torch.Tensor],
               rows: list[int] | None = None
               ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """Acceptance with the proposal launched before the host reads it: the tokens per
        request (accepted drafts, then the target's next token), and their logprobs where a
        request wants them (None: none does). ``rows``: each request's row of ``logits`` when
        they hold more (a launch some of whose requests finished).

        Greedy steps write the target's argmax into acc; with sampled requests, the token
        vanilla sampling draws at each slot (the coupling rule, exact for argmax drafts: a
        rejected draft never equals that draw's token, so "accept while equal" is the whole
        rule, on the graph and on the host alike)."""
        r, g, k = self.runner, self.graph, self.runner.k
        n = logits.shape[0] if rows is None else len(rows)
        acc = g.acc[:n]  # [n, 2k+1]
        if not all(q.params.greedy for q in reqs):
            mine = logits if rows is None else logits.index_select(0, to_device(rows, r.device))
            acc[:, :k + 1].copy_(coupled_targets(r, reqs, mine))  # [n, k+1]
        elif rows is None:  # the argmax straight into acc
            torch.argmax(logits, dim=-1, out=g.target(n))  # [n, k+1]
        else:
            acc[:, :k + 1].copy_(logits.argmax(dim=-1).index_select(
                0, to_device(rows, r.device)))
        # The drafts this step verified [n, k]: in place when the last early replay made them
        # for these rows; else gathered in.
        if not (step.same_rows and g.holds_drafts(r._drafts)):
            acc[:, k + 1:].copy_(r._drafts[:n] if step.same_rows else r._drafts.index_select(
                0, g.draft_rows(n)))
        # Logprobs of every slot's token (an emitted token is the slot's t), from the logits
        # before the replay and the next launch can overwrite them; copied ahead of acc's
        # copy, so the wait for that one covers this one too.
        ks = [q.params.logprobs for q in reqs]
        want = [i for i, x in enumerate(ks) if x is not None]
        lp_copy = None
        if want:
            at = to_device(want if rows is None else [rows[i] for i in want], r.device)
            lp_copy = r.copy_to_host(device_logprobs(
                logits.index_select(0, at).flatten(0, 1),
                acc[:, :k + 1].index_select(0, to_device(want, r.device)).reshape(-1),
                max(ks[i] for i in want)))  # [len(want) * (k+1), 1 + 2 kmax]
        copy = HostCopy(acc, g.acc_host[:acc.numel()], self._event)  # the step's one D2H
        with phase("propose"):
            step.drafts, step.probs = self.propose(step.size, n, target_hidden)
        host = r.to_host(copy, numpy=True).reshape(n, 2 * k + 1)
        self.stats.early += 1
        # The graph's rule, on the host: leading drafts equal to the argmax (vectorised, not a
        # Python scan per request: at batch 64 every per-request loop shows in the step).
        n_acc = np.cumprod(host[:, k + 1:] == host[:, :k], axis=1).sum(axis=1).tolist()
        tokens = [row[:m + 1] for row, m in zip(host[:, :k + 1].tolist(), n_acc)]
        if lp_copy is None:
            return tokens, None
        packed = lp_copy.wait().numpy()  # (done: acc's copy came after it)
        at_rows: list[list[int]] = [[] for _ in tokens]
        for j, i in enumerate(want):  # request i's slots: rows j * (k+1) ...
            at_rows[i] = list(range(j * (k + 1), j * (k + 1) + len(tokens[i])))
        return tokens, unpack_logprobs(packed, at_rows, tokens, ks)

    def propose(self, size: int, n: int, target_hidden: torch.Tensor | list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The replay (its own method so the benchmark can time it as the step's propose)."""
        return self.graph.replay(size, n, target_hidden)

    def finish(self, step: EarlyStep, reqs: list[Request], accepted: dict[int, int],
               draft: bool) -> None:
        """``ModelRunner.propose`` for an early step: nothing to launch, only which requests go
        on with the drafts, and how far their draft KV is valid (as the late path sets them)."""
        r = self.runner
        r._drafts, r._draft_probs = step.drafts, step.probs
        r._draft_row = {}
        r._drafts_k = r.verify_k
        for q in reqs:
            i = step.index.get(q.req_id)
            if i is None or not q.spec_enabled:
                continue
            if min(r.k, q.kv_limit - q.num_tokens - 1) <= 0:
                continue  # nothing left to verify: the late path skips it too
            q.draft_computed = step.starts[i] + accepted[q.req_id] + 1
            if draft:
                r._draft_row[q.req_id] = i
