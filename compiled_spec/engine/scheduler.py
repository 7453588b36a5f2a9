"""Continuous batching: which requests run this step, admission, preemption on KV exhaustion."""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable

from compiled_spec.config import SchedulerConfig, auto_min_admit
from compiled_spec.engine.request import Request, Status
from compiled_spec.kv_cache import BlockAllocator


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # query tokens per request this step (prompt chunk or 1)
    aborted: list[Request]  # requests ended this step because they can never fit

    @property
    def empty(self) -> bool:
        return not self.requests


class Scheduler:
    """Running requests decode one token per step; waiting ones are admitted (their whole prompt
    as a prefill in the same batch) while sequences, token budget and KV blocks allow. When a
    running request cannot grow, the newest running request is preempted (blocks freed, to be
    recomputed later); a request that cannot fit even alone is aborted with an error, alone."""

    def __init__(self, cfg: SchedulerConfig, allocator: BlockAllocator, lookahead: int = 0,
                 on_admit: Callable[[Request], None] | None = None) -> None:
        self.cfg = cfg
        # Prefix caching: called for a request about to be admitted with nothing computed; it
        # may put cached blocks in its table and advance num_computed past them.
        self.on_admit = on_admit
        self.allocator = allocator
        self.lookahead = lookahead  # extra slots reserved per step (speculative tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # A bulk admission that the token budget cut short goes on next step (its free slots
        # would otherwise wait for min_admit more); one that filled its slots does not, or
        # requests ending one per step would keep it open and admit them one at a time.
        self._round_cut = False

    @property
    def min_admit(self) -> int:
        """Requests a bulk admission waits for (``SchedulerConfig.min_admit``; None: a quarter of
        ``max_num_seqs``, read per step since the bench narrows max_num_seqs per batch size)."""
        m = self.cfg.min_admit
        return auto_min_admit(self.cfg.max_num_seqs) if m is None else m

    def admits_next(self, ending: int) -> bool:
        """Whether the next ``schedule`` opens admission when ``ending`` of the running requests
        end in this step (the gate of step 2 below, read before the step's bookkeeping: a
        verify launched ahead assumes the batch stays the same). May say True where the KV
        pool then refuses: that only costs the launch."""
        running = len(self.running) - ending
        return (bool(self.waiting) and running < self.cfg.max_num_seqs
                and not self._gated(running))

    def _gated(self, running: int) -> bool:
        """Bulk admission's gate with ``running`` requests running: fewer slots free than the
        round waits for (min_admit, or all that wait), and no round cut short to go on with."""
        m = self.min_admit
        return bool(running and not self._round_cut and m > 1 and
                    self.cfg.max_num_seqs - running < min(m, len(self.waiting)))

    @contextmanager
    def overriding(self, **changes: Any) -> Iterator[None]:
        """``SchedulerConfig`` fields changed for the ``with`` block, then restored (the bench
        runs at most B requests of a larger engine; start-up's dummy requests two at a time)."""
        saved = self.cfg
        self.cfg = replace(saved, **changes)
        try:
            yield
        finally:
            self.cfg = saved

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.allocator.free(req.req_id)
        req.num_computed = req.draft_computed = req.num_registered = 0
        req.num_cached_tokens = 0
        req.status = Status.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.running.remove(req)
        self.waiting.appendleft(req)

    def retry_alone(self, reqs: list[Request]) -> None:
        """Requests of a step that raised: blocks freed (recomputed later, as after preemption)
        and queued first, each marked to run its next step alone."""
        for req in reversed(reqs):
            if req in self.running:
                self._preempt(req)
                req.metrics.num_preemptions -= 1  # not a preemption: the step failed
                self.num_preemptions -= 1
            req.suspect = True

    def remove(self, req: Request, why: str) -> None:
        """Abort a request wherever it is (waiting or running) and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._abort(req, why)

    def _abort(self, req: Request, why: str) -> None:
        self.allocator.free(req.req_id)
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        req.error = why

    def _need(self, req: Request) -> int:
        # Room for this step's query tokens plus the drafts verified with them; the verifier never
        # writes KV past the request's kv_limit, so neither does the reservation.
        n = req.num_tokens  # (a property: read once, every request every step)
        return min(n + self.lookahead, max(req.kv_limit, n))

    def schedule(self) -> ScheduledBatch:
        aborted: list[Request] = []
        # 1. Grow the running requests, preempting from the newest when the pool is dry.
        tables, page = self.allocator.tables, self.allocator.page_size
        i = 0
        while i < len(self.running):
            req = self.running[i]
            need = self._need(req)
            table = tables.get(req.req_id)
            if table is not None and len(table) * page >= need:
                i += 1  # covered already (most decode steps): can_grow holds, grow is a no-op
                continue
            if self.allocator.can_grow(req.req_id, need):
                self.allocator.grow(req.req_id, need)
                i += 1
                continue
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                self.running.remove(req)
                self._abort(req, (
                    f"KV cache exhausted: request {req.req_id} needs "
                    f"{self.allocator.blocks_for(self._need(req))} blocks of "
                    f"{self.allocator.page_size} tokens for {req.num_tokens} tokens, the pool has "
                    f"{self.allocator.num_blocks}"))
                aborted.append(req)
                continue
            self._preempt(victim)  # if the victim is req itself, index i now points past the end

        # 2. Admit waiting requests: in bulk with min_admit (a round, once started, goes on over
        # the next steps while the token budget cuts it).
        budget = self.cfg.max_num_batched_tokens
        admitted: list[Request] = []
        cut = False
        gate = self._gated(len(self.running))
        while (not gate and self.waiting
               and len(self.running) + len(admitted) < self.cfg.max_num_seqs):
            req = self.waiting[0]
            if req.suspect and (self.running or admitted):
                break  # a suspect runs its next step alone (see retry_alone)
            if self.on_admit is not None and req.num_computed == 0:
                self.on_admit(req)
            n = req.num_tokens - req.num_computed
            if (admitted and n > budget) or not self.allocator.can_grow(req.req_id,
                                                                        self._need(req)):
                if req.num_computed:  # give the matched blocks back until it is admitted
                    self.allocator.free(req.req_id)
                    req.num_computed = req.draft_computed = req.num_cached_tokens = 0
            if admitted and n > budget:
                cut = True
                break
            if not self.allocator.can_grow(req.req_id, self._need(req)):
                if not self.running and not admitted:
                    self.waiting.popleft()
                    self._abort(req, (
                        f"KV cache exhausted: request {req.req_id} needs "
                        f"{self.allocator.blocks_for(self._need(req))} blocks, the pool has "
                        f"{self.allocator.num_blocks}"))
                    aborted.append(req)
                    continue
                break
            self.waiting.popleft()
            self.allocator.grow(req.req_id, self._need(req))
            req.status = Status.RUNNING
            admitted.append(req)
            budget -= n
            if req.suspect:
                break
        self._round_cut = cut
        decoding = list(self.running)
        self.running.extend(admitted)
        reqs = decoding + admitted
        return ScheduledBatch(
            requests=reqs,
            num_new_tokens=[r.num_tokens - r.num_computed for r in reqs],
            aborted=aborted,
        )

    def finish(self, req: Request, reason: str) -> None:
        self.end(req, reason)
        if req in self.running:
            self.running.remove(req)

    def end(self, req: Request, reason: str) -> None:
        """``finish`` but left in ``running`` until ``drop_finished``: a step that ends many of
        a large batch's requests removes them in one pass (list.remove each is O(batch))."""
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.allocator.free(req.req_id)

    def drop_finished(self) -> None:
        """Take the requests ``end`` finished out of ``running`` (order kept)."""
        self.running[:] = [r for r in self.running if r.status is not Status.FINISHED]
