"""Paused steps defer the draft's first pass (issue 16): while the adaptive policy pauses
speculation, a steady step keeps its target's aux states in a small ring instead of running
the draft's first pass over its one new position; once ``depth`` steps wait (and before any
other first pass) one first pass writes the draft KV of the deferred positions at once.

Why: a paused step ran the draft's first pass every step, to keep the draft's KV complete
for when drafting resumes. On the H100 (thirty-sixth session, ``adaptive.json``) paused steps
launched ahead cost 0.98 / 1.10 / 1.42 ms against vanilla's 0.77 / 0.95 / 1.06 ms at batch
1 / 16 / 64: where drafting does not pay, pausing still left the engine up to 1.34x slower
than vanilla. Here ``depth`` paused steps share one first pass (one replay of a graph captured
for ``depth`` rows per request, ``EagleProposer.sync_rows``), and each pays a device-to-device
copy of its aux rows (one tensor under graphs, which concatenate the aux layers; one per layer
on eager steps).

Depth: the flush is host work on the step that runs it (staging, the fc, the replay) while
the GPU runs out of queued work. With ``depth = k + 1`` (the forty-first session) the H200's
paused steps took 0.80 ms at the median but 1.26 ms at p90, 0.914 ms on average against
vanilla's 0.766: one step in six paid ~0.9 ms for its flush. ``flush_depth`` defaults to 32
steps per flush, fewer where one replay would pass 2048 rows (its graph's activations).

Exact by construction: the draft's KV at a position depends on that position's token and
target state and on the KV before it (causal), so one first pass over ``c`` consecutive
positions writes what ``c`` passes of one position each write (up to the rounding of other
GEMM shapes; the output never depends on the draft). The flush runs before anything reads
that KV: before every other first pass (a drafting step's, a prompt chunk's) and when the
runner is reset. A request that finished or was preempted drops its deferred rows (its
blocks are gone, or its recompute writes them again); ``draft_computed`` (the prefix
cache registers blocks only up to it) moves only when the rows are written.

Layout: ``depth + 1`` slots, each the aux rows of one deferred step as its target forward
left them (``[cap, width]`` per aux layer, rows in that step's order), used in turn; each
request keeps the position of its first deferred row and the ring rows of all of them.

Flushes: a full ring's is due once the step's aux rows are copied, and runs behind the next
target forward's launch (``run_due``: a step launched ahead calls it after that launch; else the
next deferral or flush runs it, which a late step reaches after its target forward too), so its
host work (~1.5 ms at batch 64 on the H100, forty-sixth session) overlaps the GPU's forward
instead of leaving the GPU idle. It writes every request's rows but the newest step's (at
most ``depth``, the first-pass graphs' rows per request). The others (a change to drafting, a
prompt chunk, a reset) may come while a target forward's outputs are still to be read: the
first-pass graphs have a memory pool, staging and input buffers of their own
(engine/sync_graph.py), so those replay too; a flush that no graph fits runs eagerly, counted
(``eager_flushes``).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from compiled_spec.engine.batch import Span, to_device
from compiled_spec.spec.propose_batch import ProposeBatch

if TYPE_CHECKING:
    from compiled_spec.engine.request import Request
    from compiled_spec.kv_cache import BlockAllocator
    from compiled_spec.spec.proposer import EagleProposer

log = logging.getLogger(__name__)


@dataclass
class DeferredStats:
    deferred_steps: int = 0  # paused steps whose first pass was deferred
    deferred_rows: int = 0  # ... and the positions they deferred
    flushes: int = 0  # first passes that wrote deferred positions
    flush_reasons: dict[str, int] = field(default_factory=dict)  # "full", "draft", "sync", ...
    flushed_rows: int = 0
    eager_flushes: int = 0  # of the flushes: run without a graph (none fits, or none at all)
    dropped_rows: int = 0  # of requests that finished or were preempted before a flush
    not_deferred: dict[str, int] = field(default_factory=dict)  # paused steps that synced: why
    # host seconds inside flushes (staging, the fc, the replay's launch; an eager one's ops):
    # the GPU may run dry meanwhile, so this is what deeper flushes amortize
    flush_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"deferred_steps": self.deferred_steps, "deferred_rows": self.deferred_rows,
                "flushes": self.flushes, "flush_reasons": dict(self.flush_reasons),
                "flushed_rows": self.flushed_rows, "eager_flushes": self.eager_flushes,
                "dropped_rows": self.dropped_rows,
                "not_deferred": dict(self.not_deferred),
                "flush_ms": round(1e3 * self.flush_s, 3)}  # a total: snapshots subtract


MAX_DEPTH = 32  # paused steps per flush by default
MAX_FLUSH_ROWS = 2048  # ... fewer where one flush replay would pass this many rows


def flush_depth(requested: int | None, k: int, max_num_seqs: int) -> int:
    """Paused steps per flush: ``requested`` if given, else ``MAX_DEPTH`` cut so that
    ``max_num_seqs`` requests flush at most ``MAX_FLUSH_ROWS`` rows (the sync graph's
    activations grow with them), never below ``k + 1`` (the depth before it was a setting)."""
    if requested is not None:
        return requested
    return max(k + 1, min(MAX_DEPTH, MAX_FLUSH_ROWS // max(max_num_seqs, 1)))


def _count(d: dict[str, int], why: str) -> None:
    d[why] = d.get(why, 0) + 1


@dataclass
class _Rows:
    """One request's deferred positions: ``start``, ``start + 1``, ... in ring rows ``rows``."""

    req: "Request"
    start: int
    rows: list[int]


class DeferredFirstPass:
    def __init__(self, proposer: "EagleProposer", allocator: "BlockAllocator", depth: int,
                 cap: int, behind: bool = True) -> None:
        if depth < 1 or cap < 1:
            raise ValueError(f"depth={depth}, cap={cap}: both must be >= 1")
        self.proposer, self.allocator = proposer, allocator
        self.depth = depth  # rows per request of a replayed flush (the graphs' first pass)
        self.cap = cap  # rows of one step the ring holds (a step's target rows)
        self.slots = depth + 1  # the newest step stays while the others flush
        self.behind = behind  # a full ring flushes behind the next launch (``run_due``)
        self.ring: list[torch.Tensor] | None = None  # per aux layer [slots * cap, width]
        # (listed, per aux tensor (width, dtype, device)) the ring was made for: EAGLE-3 hands
        # its aux states as a list, EAGLE-1 one tensor
        self._key: tuple[bool, list[tuple[int, torch.dtype, torch.device]]] | None = None
        self.next_slot = 0
        self.live = 0  # slots holding rows not yet written
        self.pending: dict[int, _Rows] = {}  # req_id -> its deferred rows
        # The current run: steps of the same requests in the same rows, each one position on.
        # Its steps record only their slot's first row (``_bases``); each request's rows are
        # written out in bulk (``_settle``). Per request and step, the Python work was most of
        # a paused step's deferral at batch 64 (0.26 ms a step on the H100, forty-third session).
        self._run: tuple[list["Request"], list[int]] | None = None  # (requests, their rows)
        self._expect: list[int] = []  # each run request's next position
        self._bases: list[int] = []
        # A full ring's flush not run yet: the newest slot's first row (it stays deferred)
        self._due: int | None = None
        self.stats = DeferredStats()

    def _ring_for(self, aux: list[torch.Tensor], listed: bool) -> list[torch.Tensor] | None:
        """The ring, made at the first deferral from the aux states' widths and dtype (again when
        they change and nothing is pending: the engine switched between graphs, which hand
        them concatenated, and eager steps); None when they do not fit it."""
        key = (listed, [(h.shape[1], h.dtype, h.device) for h in aux])
        if key == self._key:
            return self.ring
        if self.pending:
            return None
        self._key = key
        self.ring = [torch.empty(self.slots * self.cap, w, dtype=dt, device=dev)
                     for w, dt, dev in key[1]]
        return self.ring

    def defer(self, reqs: "list[Request]", starts: list[int], rows: list[int],
              target_hidden: torch.Tensor | list[torch.Tensor]) -> str | None:
        """Keep one first-pass position per request (``starts[i]``, its target state in row
        ``rows[i]`` of ``target_hidden``) for a later flush: None when deferred, else why not
        (the caller then runs the first pass now, after ``flush``). Called once the step's
        logits are read and before the next target forward (it may replay a flush)."""
        self.run_due()  # before this step's copy takes the oldest slot
        aux = target_hidden if isinstance(target_hidden, list) else [target_hidden]
        n_rows = aux[0].shape[0]  # [T, width]: the target forward's rows, all copied
        if n_rows > self.cap:
            return self._not("rows")
        run = self._run
        # (list equality tests identity first: the same request objects, a C loop)
        same = run is not None and reqs == run[0] and rows == run[1] and starts == self._expect
        ds: list[_Rows | None] = []
        if not same:
            ds = [self.pending.get(r.req_id) for r in reqs]
            self._settle()
            for r, p, d in zip(reqs, starts, ds):
                if (p != r.draft_computed if d is None
                        else p != d.start + len(d.rows) or d.req is not r):
                    return self._not("not_consecutive")  # a first pass must cover the gap first
        ring = self._ring_for(aux, isinstance(target_hidden, list))
        if ring is None:
            return self._not("aux_shape")
        base = self.next_slot * self.cap
        for h, src in zip(ring, aux):  # behind the target forward, before the next overwrites it
            h[base:base + n_rows].copy_(src)
        self.next_slot = (self.next_slot + 1) % self.slots
        self.live += 1
        if same:
            self._bases.append(base)
        else:
            for r, p, row, d in zip(reqs, starts, rows, ds):
                if d is None:
                    self.pending[r.req_id] = _Rows(r, p, [base + row])
                else:
                    d.rows.append(base + row)
            self._run = (list(reqs), list(rows))
        self._expect = [p + 1 for p in starts]
        self.stats.deferred_steps += 1
        self.stats.deferred_rows += len(reqs)
        if self.live == self.slots:  # the next step's copy would overwrite the oldest slot
            self._due = base
            if not self.behind:  # before the next launch (the forty-eighth session's order)
                self.run_due()
        return None

    def run_due(self) -> bool:
        """A full ring's flush, if one is due (then True): called once the next target forward
        is launched (the module docstring)."""
        if self._due is None:
            return False
        newest, self._due = self._due, None
        self._flush("full", newest=newest)
        return True

    def _not(self, why: str) -> str:
        _count(self.stats.not_deferred, why)
        return why

    def _settle(self) -> None:
        """Write the current run's rows into each request's list, and end the run."""
        run, bases = self._run, self._bases
        self._run, self._bases = None, []
        if run is None or not bases:
            return
        # [n, steps]: request i's ring row of each step, one numpy op (a Python list per
        # request was 0.2 ms of a 2048-row flush on the CPU, forty-ninth session)
        rows = np.add.outer(np.asarray(run[1]), np.asarray(bases)).tolist()
        pending = self.pending
        for r, mine in zip(run[0], rows):
            pending[r.req_id].rows.extend(mine)

    def _live(self, d: _Rows) -> int:
        """How many of ``d``'s rows may be written now: those whose token and target KV are
        still the request's (0 once it finished or was preempted: its blocks are gone or its
        recompute writes them again)."""
        r = d.req
        if r.req_id not in self.allocator.tables or r.draft_computed != d.start:
            return 0
        return max(0, min(len(d.rows), r.num_computed - d.start, r.num_tokens - 1 - d.start))

    def flush(self, why: str) -> None:
        """Write the draft KV of every deferred position that is still live, now, eagerly (see
        the module docstring: a target forward's outputs may still be unread)."""
        self._due = None  # its rows are written here, the newest step's too
        if self.pending:
            self._flush(why)

    def flush_or_drop(self, why: str) -> None:
        """``flush`` where a step failed (the runner's reset): if the flush raises too, the rows
        are dropped (the draft's KV keeps stale entries there, which costs acceptance, never
        output) and the engine's recovery goes on."""
        try:
            self.flush(why)
        except Exception as e:  # noqa: BLE001 - the reset must not fail the recovery
            self.drop()
            log.warning("deferred draft first pass dropped on reset: %s: %s",
                        type(e).__name__, e)

    @torch.inference_mode()
    def _flush(self, why: str, newest: int | None = None) -> None:
        """One first pass over the deferred rows, replayed from a first-pass graph where one
        fits; ``newest`` (a full ring: the slot just written, its first row) stays deferred."""
        t0 = time.perf_counter()
        try:
            self._write(why, newest)
        finally:
            self.stats.flush_s += time.perf_counter() - t0

    def _write(self, why: str, newest: int | None) -> None:
        self._settle()
        pending, self.pending = self.pending, {}
        self.live = 0
        spans, tokens, ring_rows, reqs = [], [], [], []
        for d in pending.values():
            c = self._live(d)
            # Its newest row waits for the next flush, if it is in the newest slot and live
            # (the late path has read that step's token already: live, but kept all the same).
            kept = (newest is not None and newest <= d.rows[-1] < newest + self.cap
                    and c >= len(d.rows) - 1)
            if kept:
                c = len(d.rows) - 1
                self.pending[d.req.req_id] = _Rows(d.req, d.start + c, d.rows[c:])
            self.stats.dropped_rows += len(d.rows) - c - kept
            if c == 0:
                continue
            r = d.req
            spans.append(Span(r.req_id, d.start, c))
            tokens.extend(r.tokens(d.start + 1, d.start + 1 + c))
            ring_rows.extend(d.rows[:c])
            reqs.append(r)
        if self.pending:
            self.live = 1
        if not reqs:
            return
        _count(self.stats.flush_reasons, why)
        self.stats.flushes += 1
        self.stats.flushed_rows += len(ring_rows)
        idx = to_device(ring_rows, self.ring[0].device)
        aux = [h.index_select(0, idx) for h in self.ring]  # [T, width] in the batch's order
        listed = self._key[0]
        batch = ProposeBatch(first_pass=spans, token_ids=tokens,
                             hidden_rows=list(range(len(ring_rows))),
                             step_limits=[s.start + s.length - 1 for s in spans],
                             temperature=[r.params.temperature for r in reqs],
                             seeds=[r.seed for r in reqs])
        graphs = self.proposer.sync_graph
        if graphs is None or not graphs.run(batch, aux if listed else aux[0]):
            self.stats.eager_flushes += 1  # no graph fits (or none: CPU), counted there too
            self.proposer.first_pass(batch, self._per_layer(aux) if listed else aux[0])
        for r, s in zip(reqs, spans):
            r.draft_computed = s.start + s.length

    def _per_layer(self, aux: list[torch.Tensor]) -> list[torch.Tensor]:
        """EAGLE-3's aux states one tensor per layer, as uncaptured target steps give them to the
        compiled first pass (graphs give them concatenated, [T, n * target_h]): one form only,
        or Dynamo compiles the first pass again for the other (it guards on ``len(aux)``)."""
        n = len(self.proposer.draft.config.aux_layer_ids or ())
        if len(aux) != 1 or n <= 1:
            return aux
        return [part.contiguous() for part in aux[0].chunk(n, dim=1)]  # [T, target_h] each

    def drop(self) -> None:
        """Forget every deferred row (their requests recompute, or ended)."""
        self._settle()
        for d in self.pending.values():
            self.stats.dropped_rows += len(d.rows)
        self.pending, self.live, self._due = {}, 0, None
