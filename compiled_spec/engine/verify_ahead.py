"""Verify ahead (issues 14/16): a step launches the NEXT step's target forward before the engine's
bookkeeping and scheduling: an early chain step as soon as the host has read its acceptance, a
greedy decode step (vanilla) before the host even reads its token; early tree steps in
``engine.verify_ahead_tree``. On by default for CUDA devices since the fifteenth session's H200
A/B (batch 1: vanilla 880.8 -> 986.8 tok/s, chain k=5 1898.6 -> 1937.3).

With early propose (engine/early_propose.py) a chain step runs: verify -> acceptance copy ->
proposal (on the GPU) while the host waits for the copy, then does the step's bookkeeping,
schedules, stages and launches the next verify. On the H200 (thirteenth session, chain k=5,
batch 1) a step took 1.83 ms against 0.40 ms of propose and 1.16 ms of verify: the GPU idled
~0.27 ms a step waiting for that host work once the proposal was done.

Here the host stages the next verify right after the copy, assuming every request of the step
goes on (its span starts after its accepted tokens, the target's token first, then the k
drafts still on the device) and launches it behind the proposal; the GPU never waits for the
bookkeeping. The next step takes the launched verify if its batch is that batch or a subset of
it in the same order (requests that finished are dropped rows: their outputs are not read),
each request at the staged position with k drafts to verify. Anything else discards it and
runs the step as usual, counted by reason (``VerifyAheadStats``), never silently:

* a discarded verify wrote the target KV of positions its requests would write next anyway
  (the same tokens at the same positions: a request going on rewrites identical values) or of
  finished requests, in blocks they still own, in stream order before anything reuses them;
* its outputs are graph memory that the next replay overwrites, and nothing reads them.

Not launched when the next step admits waiting requests (the requests ending in this step
free slots the scheduler fills: the next batch would change), when a request would verify
fewer than k drafts next step, when every request ends (a stop token, EOS, its budget), or
over ``max_batch`` requests.

Vanilla decoding (k = 0) goes one step further: nothing is queued on the GPU while the
host reads a decode step's token (on the H200, thirteenth session, a SmolLM2 decode step took
1.153 ms against 0.914 ms of forward), so the next decode is launched from the device argmax
itself (a device-to-device copy into the graph's token buffer), before the host waits; the
host then reads step N's token while step N+1 runs. Launched when every request decodes one
token next at a known position (prompts fully computed, not at its budget), with
the next position's KV block grown now; greedy or sampled (the token on the device is the
argmax or vanilla's draw, ``sampled_accept.coupled_targets``), with logprobs computed on the
device before the launch (``logprobs.device_logprobs``). An EAGLE engine whose adaptive
policy paused speculation does the same, after replaying the draft's first pass from that token
(``engine.paused_ahead``); a launched decode carries k = 0 so the next step takes it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from capture.host_stage import HostBatch
from compiled_spec.engine.batch import Span, build_chain_batch, to_device
from compiled_spec.engine.early_propose import HostCopy
from compiled_spec.engine.request import Request
from compiled_spec.profile import phase

if TYPE_CHECKING:
    from compiled_spec.engine.early_propose import EarlyStep
    from compiled_spec.engine.model_runner import ModelRunner


@dataclass
class VerifyAheadStats:
    launched: int = 0  # verifications launched before the step's bookkeeping
    taken: int = 0  # ... and used by the next step as launched
    taken_subset: int = 0  # ... used for the requests that went on (others had finished)
    discarded: dict[str, int] = field(default_factory=dict)  # launched, not used: why
    skipped: dict[str, int] = field(default_factory=dict)  # early steps not launching: why

    def as_dict(self) -> dict[str, Any]:
        return {"launched": self.launched, "taken": self.taken,
                "taken_subset": self.taken_subset, "discarded": dict(self.discarded),
                "skipped": dict(self.skipped)}


@dataclass
class _Launched:
    spans: list[Span]  # per request: its verified span (start: its last token's position)
    logits: torch.Tensor  # [n, k+1, V]
    target_hidden: torch.Tensor | list[torch.Tensor]  # [n * (k+1), h] (per aux layer)
    k: int  # drafts per request it verifies (0: a decode, vanilla or speculation paused)


@dataclass
class Ahead:
    """What ``ModelRunner.execute`` needs in place of its own prepare and verify."""

    spans: list[Span]
    num_draft: list[int]
    logits: torch.Tensor  # [n, k+1, V], or the whole launch's [N, k+1, V] with ``rows``
    row_start: list[int]  # each request's first row in target_hidden
    target_hidden: torch.Tensor | list[torch.Tensor]
    # Some launched requests had finished: each request's row of ``logits`` (the launch's
    # rows stay where they are: no gather of logits, hidden states or the fc per such step).
    rows: list[int] | None = None


def _stops(q: Request, toks: list[int], eos: set[int]) -> bool:
    """Whether one of ``toks`` stops ``q`` by its id alone (``stops_on_token`` over a step's
    tokens, without a call per token)."""
    p = q.params
    return ((not p.ignore_eos and not eos.isdisjoint(toks))
            or bool(p.stop_token_ids) and not set(p.stop_token_ids).isdisjoint(toks))


def _count(d: dict[str, int], why: str) -> None:
    d[why] = d.get(why, 0) + 1


class VerifyAhead:
    def __init__(self, runner: "ModelRunner", enabled: bool = False, max_batch: int = 64) -> None:
        self.runner = runner
        self.enabled = enabled  # EngineConfig.verify_ahead
        self.max_batch = max_batch
        # Set by the engine (``Scheduler.admits_next``): whether the next step admits a waiting
        # request when this many of this step's end; a launch would then be discarded.
        self.admits_next: Callable[[int], bool] = lambda ending: False
        self.eos_token_ids: set[int] = set()  # set by the engine: the model's EOS ids
        self.stats = VerifyAheadStats()
        self._launched: _Launched | None = None
        self._index: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # _draft_index

    def skip(self, why: str) -> None:
        _count(self.stats.skipped, why)

    def clear(self) -> None:
        """Forget a launched verify (the runner was reset: a fault, or requests aborted)."""
        if self._launched is not None:
            _count(self.stats.discarded, "reset")
        self._launched = None

    def _kept(self, reqs: list[Request], launched: list[int]) -> list[int] | None:
        """Each request's row in a launch over the requests ``launched``: all of them, or those
        that went on (finished ones dropped), in order; None for any other batch (the launch
        is discarded, counted)."""
        pos = {rid: i for i, rid in enumerate(launched)}
        keep = [pos.get(q.req_id, -1) for q in reqs]
        if -1 in keep or keep != sorted(keep):
            _count(self.stats.discarded, "batch")
            return None
        return keep

    def _kept_hidden(self, hidden: torch.Tensor | list[torch.Tensor], keep: list[int],
                     width: int) -> tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]]:
        """(the kept rows [n' * width], the target hidden of those rows): each request owns
        ``width`` consecutive rows of the launch. The next proposal's fc is issued over them
        where a graphed proposer will take it."""
        r = self.runner
        rows = to_device([i * width + j for i in keep for j in range(width)], r.device)
        if r.proposer is None:  # vanilla reads no hidden states
            return rows, hidden
        hidden = ([h.index_select(0, rows) for h in hidden] if isinstance(hidden, list)
                  else hidden.index_select(0, rows))
        if r.aux_layer_ids and r.proposer.graph is not None:
            r.proposer.precombine(hidden)
        return rows, hidden

    def _why_not_batch(self, reqs: list[Request]) -> str | None:
        """Why no step of ``reqs`` launches ahead whatever its requests (None: it may)."""
        if not self.enabled:
            return "off"
        return "batch" if len(reqs) > self.max_batch else None

    def num_ending(self, reqs: list[Request], new_tokens: list[list[int]]) -> int:
        """Requests this step ends: by a token alone (``stops_on_token``: EOS unless ignored, a
        stop token id) or at their budget. When all end, a launch would be discarded; where only
        some do, it goes on and the next step takes the others' rows. Stop strings are not read
        here: a request one ends is a discarded launch, counted."""
        eos = self.eos_token_ids
        return sum(1 for q, toks in zip(reqs, new_tokens)
                   if q.num_tokens + len(toks) >= q.max_total_tokens or _stops(q, toks, eos))

    def _why_not_ending(self, reqs: list[Request], new_tokens: list[list[int]]) -> str | None:
        """Why the requests ending this step keep a launch from paying: all end, or their
        freed slots let the scheduler admit (the next batch would carry prompts). Waiting
        requests alone do not: with bulk admission (``SchedulerConfig.min_admit``) most steps
        of a full engine admit nothing."""
        return self._why_not_ends(self.num_ending(reqs, new_tokens), len(reqs))

    def _why_not_ends(self, ending: int, n: int) -> str | None:
        """``_why_not_ending`` given how many of the step's ``n`` requests end."""
        if ending == n:
            return "stopping"
        return "admitting" if self.admits_next(ending) else None

    def launch(self, reqs: list[Request], step: "EarlyStep", new_tokens: list[list[int]]) -> None:
        """After an early step's acceptance is read, before the engine's bookkeeping: the next
        step's verification of the drafts ``step`` proposed, every request assumed to go on."""
        self._launched = None
        why = self._why_not_batch(reqs)
        if why is not None:
            _count(self.stats.skipped, why)
            return
        r, k = self.runner, self.runner.k
        if r.verify_k < k:  # the next step verifies fewer drafts than this launch would
            _count(self.stats.skipped, "shrunk")
            return
        q1 = k + 1
        spans: list[Span] = []
        req_ids: list[int] = []
        starts: list[int] = []
        limits: list[int] = []
        tables, page, eos = r.allocator.tables, r.allocator.page_size, self.eos_token_ids
        # One pass over the batch (each per-request loop shows in a batch-64 step): whether a
        # launch would pay (as ``num_ending`` and ``_why_not_ending``), and its spans.
        ending, not_spec, short = 0, False, False
        for q, toks in zip(reqs, new_tokens):
            n_tok = q.num_tokens + len(toks)
            at_budget = n_tok >= q.max_total_tokens
            if at_budget or _stops(q, toks, eos):
                ending += 1
            if not q.spec_enabled:
                not_spec = True
            elif not at_budget and q.kv_limit - n_tok - 1 < k:
                short = True  # it goes on with fewer than k drafts (near max_model_len)
            # This step verified from q.num_computed (one query token, then k drafts) and
            # emitted len(toks); the next starts at its last emitted token.
            start = q.num_computed + len(toks)
            # A request at its budget ends here (verified to kv_limit, it may have accepted
            # past it): its rows stay, for the others' row order, but inert past its blocks.
            limit = min(q.kv_limit, len(tables[q.req_id]) * page) if at_budget else None
            spans.append(Span(q.req_id, start, q1, limit))
            req_ids.append(q.req_id)
            starts.append(start)
            limits.append(start + q1 if limit is None else limit)
        why = (self._why_not_ends(ending, len(reqs))
               or ("not_spec" if not_spec else "short" if short else None))
        if why is not None:
            _count(self.stats.skipped, why)
            return
        n = len(reqs)
        host_ids = np.zeros(n * q1, dtype=np.int64)  # drafts filled from the device
        host_ids[::q1] = [toks[-1] for toks in new_tokens]
        dst, src = self._draft_index(n, k)
        # Request i's rows take row i of the drafts [n, k]: one strided copy stages them.
        self._launch(build_chain_batch(r.allocator, req_ids, starts, limits, q1, host_ids, dst,
                                       src, (q1, 1)), spans, k, step.drafts)

    def _draft_index(self, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(rows of the launched batch taking drafts, their flat index in the proposal): row
        i * (k + 1) + 1 + j takes draft j of proposal row i (the same every step of n)."""
        key = (n, k)
        idx = self._index.get(key)
        if idx is None:
            dst = (np.arange(n)[:, None] * (k + 1) + 1 + np.arange(k)).reshape(-1)
            idx = self._index[key] = (dst, np.arange(n * k))
        return idx

    def _launch(self, hb: HostBatch, spans: list[Span], k: int,
                drafts: torch.Tensor) -> None:  # [n, k] (chain) or [n, 1] (decode)
        """The target forward over ``hb`` (its draft rows read from ``drafts``), kept for the
        next step."""
        with phase("verify"):
            logits, _, hidden = self.runner._verify(hb, spans, [k] * len(spans), drafts)
        self._launched = _Launched(spans, logits, hidden, k)
        self.stats.launched += 1

    def decode(self, reqs: list[Request], num_new: list[int],
               tok: torch.Tensor,  # [B] this step's tokens (argmax or sampled), on the device
               first: Callable[[], str | None] | None = None,
               ) -> HostCopy:
        """Greedy decoding: ``tok``'s copy to the host issued, then the next decode step
        launched behind it (a copy issued after the launch would wait for that step).
        ``first``: what must run before the launch once it is due (a paused EAGLE step's draft
        first pass, engine/paused_ahead.py); a reason string from it skips the launch."""
        copy = self.runner.copy_to_host(tok)
        self.launch_decode(reqs, num_new, tok, first)
        return copy

    def launch_decode(self, reqs: list[Request], num_new: list[int],
                      tok: torch.Tensor,  # [B] this step's tokens, on the device
                      first: Callable[[], str | None] | None = None) -> None:
        """The next decode step of every request, its token taken from ``tok`` on the device."""
        self._launched = None
        why = self._why_not_decode(reqs, num_new)
        # Vanilla and paused steps alike: the token's draw and copy and these checks end here,
        # so ``paused_sync`` below is the paused step's own work and ``verify_build`` the batch
        # build in both (the fifty-fifth session read the checks as paused-only cost).
        self.runner.clock.mark("decode_check")
        if why is None and first is not None:
            why = first()
            self.runner.clock.mark("paused_sync")  # its deferral (a flush now and then)
        if why is not None:
            _count(self.stats.skipped, why)
            return
        r = self.runner
        n = len(reqs)
        # Its KV slot: this step's requests hold blocks up to their last computed position.
        if not r.allocator.grow_all([(q.req_id, q.num_computed + m + 1)
                                     for q, m in zip(reqs, num_new)]):
            _count(self.stats.skipped, "kv_exhausted")
            return
        spans = [Span(q.req_id, q.num_computed + m, 1) for q, m in zip(reqs, num_new)]
        every = self._every(n)  # row i takes token i (on the device)
        self._launch(build_chain_batch(r.allocator, [sp.req_id for sp in spans],
                                       [sp.start for sp in spans], None, 1,
                                       np.zeros(n, dtype=np.int64), every, every, (1, 0)),
                     spans, 0, tok.view(n, 1))

    def _every(self, n: int) -> np.ndarray:
        """[n] 0 .. n - 1 (made once per n)."""
        return self._draft_index(n, 1)[1]

    def _why_not_decode(self, reqs: list[Request], num_new: list[int]) -> str | None:
        why = self._why_not_batch(reqs)
        if why is not None:
            return why
        # This step's tokens are not read yet: only a request at its budget is known to end,
        # and that one skips as "short" below.
        if self.admits_next(0):
            return "admitting"
        for q, m in zip(reqs, num_new):
            n = q.num_tokens
            if q.num_computed + m != n:
                return "prefill"  # a chunked prompt goes on next step
            if n + 1 >= q.max_total_tokens:
                return "short"  # this step's token is its last
        return None

    def take(self, reqs: list[Request], num_new: list[int]) -> Ahead | None:
        """The launched verify for this step's batch, or None (it is discarded, counted)."""
        a, self._launched = self._launched, None
        if a is None:
            return None
        r, k = self.runner, a.k
        if max(num_new) != 1:
            _count(self.stats.discarded, "batch")
            return None
        keep = self._kept(reqs, [s.req_id for s in a.spans])
        if keep is None:
            return None
        for q, i in zip(reqs, keep):
            if (q.num_computed != a.spans[i].start or r.num_drafts_for(q) != k
                    or (k > 0 and r._draft_row.get(q.req_id) != i)):
                _count(self.stats.discarded, "state")
                return None
        n = len(keep)
        if n < len(a.spans):  # finished requests' rows stay, unread
            self.stats.taken_subset += 1
            return Ahead(spans=[a.spans[i] for i in keep], num_draft=[k] * n, logits=a.logits,
                         row_start=[i * (k + 1) for i in keep], target_hidden=a.target_hidden,
                         rows=keep)
        self.stats.taken += 1
        return Ahead(spans=a.spans, num_draft=[k] * n, logits=a.logits,
                     row_start=[i * (k + 1) for i in range(n)], target_hidden=a.target_hidden)
