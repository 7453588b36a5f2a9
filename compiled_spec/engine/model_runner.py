"""Runs one engine step on the device: the target forward over prompts and [last token, drafts],
sampling / rejection sampling, and (for speculative engines) the next proposal.

Vanilla decoding is the k = 0 case of the same code path. Per step there is exactly one
device-to-host copy: the emitted tokens and acceptance counts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from capture.host_stage import HostBatch
from compiled_spec.engine.batch import (Span, build_host_batch, greedy_accept,
                                        host_batch_to_device, to_device, verify_logits)
from compiled_spec.engine.deferred_first_pass import DeferredFirstPass
from compiled_spec.engine.early_propose import EarlyPropose, EarlyStep, HostCopy
from compiled_spec.engine.host_clock import GpuIdleProbe, HostClock
from compiled_spec.engine.logprobs import (TokenLogprobs, device_logprobs, gather_logprobs,
                                            unpack_logprobs)
from compiled_spec.engine.paused_ahead import sync_ahead
from compiled_spec.engine.prompt_head import HeadPlan, PromptHead
from compiled_spec.engine.request import Request
from compiled_spec.engine.sample_graph import SampleGraphs
from compiled_spec.engine.sampled_accept import coupled_targets, sampled_accept
from compiled_spec.engine.verify_ahead import VerifyAhead
from compiled_spec.kv_cache import BlockAllocator, KVCacheExhausted
from compiled_spec.models.decoder import CausalLM
from compiled_spec.profile import phase
from compiled_spec.spec.proposer import EagleProposer, ProposeBatch


@dataclass
class StepOutput:
    new_tokens: list[list[int]]  # per request: accepted drafts then the sampled token
    num_draft: list[int]  # drafts verified per request (0 for prefill / vanilla)
    # Per request, per emitted token (None: not asked for); see engine/logprobs.py.
    logprobs: list[list[dict[int, float]] | None] | None = None


@dataclass
class _Pending:
    """What the proposer needs from this step's target forward."""

    hidden: torch.Tensor | list[torch.Tensor]
    spans: list[Span]  # the target's query span per request
    row_start: list[int]  # first flat row of each request
    num_draft: list[int]
    # Tree steps: the target rows of each request's root and accepted nodes (not contiguous).
    rows_by_req: dict[int, list[int]] | None = None


class ModelRunner:
    def __init__(self, model: CausalLM, allocator: BlockAllocator, device: torch.device,
                 max_model_len: int, proposer: EagleProposer | None = None,
                 aux_layer_ids: tuple[int, ...] = ()) -> None:
        self.model = model
        self.target_fn = model  # swapped for the compiled module when compile=True
        self.allocator = allocator
        self.device = device
        self.max_model_len = max_model_len
        self.proposer = proposer
        self.aux_layer_ids = aux_layer_ids
        self.k = proposer.k if proposer is not None else 0
        self.lookahead = self.k  # positions past the last token a step may write
        self._drafts: torch.Tensor | None = None  # [B_prev, k] from the last proposal
        self._draft_probs: torch.Tensor | None = None  # [B_prev, k, V] when drafts are sampled
        self._draft_row: dict[int, int] = {}  # req_id -> row in the tensors above
        # Drafts the next step verifies of those this step proposes (an adaptive policy's
        # shrunk k sets it before the step), and of those the last step proposed.
        self.verify_k = self.k
        self._drafts_k = self.k
        # This step's paused first pass, handled ahead (paused_ahead.py): "synced" (it ran) or
        # "deferred" (its position kept for a later flush); None: not handled yet.
        self._synced: str | None = None
        # Paused steps' first passes kept for one later pass (adaptive engines; set by the engine).
        self.deferred: DeferredFirstPass | None = None
        self._pending: _Pending | None = None
        # Chain steps propose before the host reads their acceptance (engine/early_propose.py).
        self.early: EarlyPropose | None = EarlyPropose(self)
        # A step may launch the next one's target forward before the bookkeeping (verify_ahead.py).
        self.ahead = VerifyAhead(self)
        # A sampled step's draws by graph replay (engine/sample_graph.py; set with the graphs).
        self.sample_graph: SampleGraphs | None = None
        self._early_step: EarlyStep | None = None  # this step's, until ``propose`` takes it
        # Seconds the host spent blocked in the step's device-to-host copy, i.e. waiting for
        # the GPU: a step whose wait is a small share of its time is host-bound (stats).
        self.host_wait_s = 0.0
        # The step's host time by phase (the engine's clock, shared: engine/host_clock.py).
        self.clock = HostClock()
        self.gpu_probe = GpuIdleProbe(self.device)  # did the GPU idle before each verify?
        # A prompt step's draft pass over its prompts' heads, run inside ``to_host`` between
        # issuing the step's copy and waiting for it (engine/prompt_head.py).
        self.prompt_head = PromptHead(self)
        self._head: HeadPlan | None = None
        # The step's copy to the host when issued early (``copy_to_host``): pinned
        # destinations by dtype, reused, and the event after the copy
        self._d2h: dict[torch.dtype, torch.Tensor] = {}
        self._d2h_event = torch.cuda.Event() if self.device.type == "cuda" else None

    def to_host(self, t: torch.Tensor | HostCopy, numpy: bool = False) -> list | np.ndarray:
        """The step's one device-to-host copy (a list, or an array for ``numpy``); the time it
        blocks is counted. A ``HostCopy`` was issued earlier: this waits for it."""
        self.clock.mark("accept")  # the host's work up to its wait
        head, self._head = self._head, None
        if head is not None:  # the copy issued first: the wait is then for it alone
            if not isinstance(t, HostCopy):
                t = self.copy_to_host(t)
            self.prompt_head.launch(head)
            self.clock.mark("prompt_head")
        t0 = time.perf_counter()
        if isinstance(t, HostCopy):
            host = t.wait()
            out = host.numpy() if numpy else host.tolist()
        else:
            out = t.cpu().numpy() if numpy else t.tolist()
        self.host_wait_s += time.perf_counter() - t0
        self.clock.mark("wait")
        return out

    def copy_to_host(self, t: torch.Tensor) -> HostCopy:
        """``t``'s copy to the host issued without waiting, into a reused pinned buffer of its
        dtype that the host reads before the next such copy of that dtype (a step issues at
        most one per dtype: its tokens, int64, and its logprobs, float64); its ``wait`` gives
        ``t``'s shape."""
        n = t.numel()
        buf = self._d2h.get(t.dtype)
        if buf is None or buf.numel() < n:
            buf = self._d2h[t.dtype] = torch.empty(max(n, 1024), dtype=t.dtype,
                                                   pin_memory=self.device.type == "cuda")
        return HostCopy(t, buf[:n].view(t.shape), self._d2h_event)

    def reset(self) -> None:
        """Forget the last proposal and pending hidden states (after a step raised, or requests
        were aborted mid-step): the next step verifies no drafts, which stays exact."""
        self._drafts = self._draft_probs = self._pending = self._early_step = None
        self._head = None
        self._draft_row = {}
        self._drafts_k = self.k
        self._synced = None
        self.ahead.clear()
        if self.deferred is not None:  # the requests that go on keep their draft KV
            self.deferred.flush_or_drop("reset")

    def flush_deferred(self, why: str) -> None:
        """Write the draft KV that paused steps deferred, before a first pass reads it."""
        if self.deferred is not None:
            self.deferred.flush(why)

    @property
    def paused(self) -> bool:
        """The engine's adaptive policy chose not to draft in this step."""
        return self.early is not None and self.early.paused

    def num_drafts_for(self, req: Request) -> int:
        """Drafts to verify this step: what was proposed, capped so no KV is written past the
        request's kv_limit. Near max_tokens that is still k (the step keeps the batch's shape:
        the engine drops what passes the budget, ``LLMEngine._run``); near max_model_len k
        shrinks, and where the adaptive policy shrank it (``verify_k`` when they were drafted)."""
        if req.req_id not in self._draft_row or req.num_computed != req.num_tokens - 1:
            return 0
        return max(0, min(self._drafts_k, req.kv_limit - req.num_tokens - 1))

    @torch.inference_mode()
    def execute(self, reqs: list[Request], num_new: list[int]) -> StepOutput:
        # The verify an early step launched for this batch (engine/verify_ahead.py), if it fits.
        if not self.paused:
            self.flush_deferred("draft")  # this step drafts: its first pass reads that KV
        ahead = self.ahead.take(reqs, num_new)
        logit_rows = None  # with a launch taken for some of its requests: theirs (see Ahead)
        if ahead is not None:
            spans, num_draft = ahead.spans, ahead.num_draft
            logits, row_start, target_hidden = ahead.logits, ahead.row_start, ahead.target_hidden
            logit_rows = ahead.rows
        else:
            with phase("prepare"):
                hb, spans, num_draft = self._prepare(reqs, num_new)
            with phase("verify"):
                drafts = None if self._drafts is None else self._drafts.reshape(-1)
                logits, row_start, target_hidden = self._verify(hb, spans, num_draft, drafts)
        clock = self.clock
        clock.mark("verify")
        # Staged while the verify runs; None: this step proposes late (the reason counted).
        early = None if self.early is None else self.early.plan(reqs, num_new, num_draft,
                                                                row_start)
        clock.mark("plan")
        logprobs = any(r.params.logprobs is not None for r in reqs)
        # Prompt heads: their draft pass runs in ``to_host``, before its wait (which a step
        # verifying drafts with logprobs to read after the wait cannot have: the head's replay
        # may reuse the logits' graph memory; a step without drafts computes them before).
        self._head = head = None if early is not None or ahead is not None else \
            self.prompt_head.plan(reqs, spans, num_draft, row_start, target_hidden,
                                  logprobs and max(num_draft) > 0)
        if early is None and logit_rows is not None:  # the late paths read them in order
            logits = logits.index_select(0, to_device(logit_rows, self.device))
        with phase("rejection_sample"):
            if early is not None:  # (with the logprobs it computed before its replay)
                new_tokens, lp = self.early.accept(early, reqs, logits, target_hidden,
                                                   logit_rows)
            else:
                new_tokens, lp = self._accept(reqs, logits, num_draft, num_new, row_start,
                                              target_hidden, logprobs)
        clock.mark("accept")
        if early is not None:  # the next verify, before the engine's bookkeeping
            self.ahead.launch(reqs, early, new_tokens)
            clock.mark("launch_ahead")
        self._early_step = early
        self._head = None  # (taken by ``to_host`` unless this step never waited)
        if head is not None and head.hidden is not None:  # the proposal starts after the heads
            self._pending = _Pending(hidden=head.hidden, spans=head.rest_spans,
                                     row_start=head.rest_row_start, num_draft=num_draft)
        else:
            self._pending = None if early is not None else _Pending(
                hidden=target_hidden, spans=spans, row_start=row_start, num_draft=num_draft)
        return StepOutput(new_tokens=new_tokens, num_draft=num_draft, logprobs=lp)

    def _verify(self, hb: HostBatch, spans: list[Span], num_draft: list[int],
                drafts: torch.Tensor | None,  # [B_prev * k] the last proposal's, flat (or
                # [B, k] placed by ``hb.draft_grid``)
                ) -> tuple[torch.Tensor, list[int], torch.Tensor | list[torch.Tensor]]:
        """The target forward over ``hb``: (logits [B, K+1, V], row_start, target hidden); the
        logits are fp32, or the model dtype where a graph computed them (``_logits_fn``)."""
        run_host = getattr(self.target_fn, "run_host", None)
        clock = self.clock
        clock.mark("verify_build")
        self.gpu_probe.before()
        if run_host is not None:  # CUDA graphs: staged straight into the static buffers
            hidden, aux = run_host(hb, drafts, self.aux_layer_ids)
        else:
            input_ids, positions, meta = host_batch_to_device(hb, self.device, drafts)
            hidden, aux = self.target_fn(input_ids, positions, meta, self.aux_layer_ids)
        self.gpu_probe.after()
        clock.mark("verify_replay")
        logits, row_start = verify_logits(self._logits_fn(upcast=False), hidden, spans,
                                          num_draft, self.device)
        clock.mark("verify_logits")
        # Decoding with a graphed propose to follow: its fc issued before the acceptance's
        # host wait (the O(batch) check only where there are graphs).
        longest = max(s.length for s in spans)
        if (self.aux_layer_ids and self.proposer is not None
                and self.proposer.graph is not None and longest <= self.k + 1
                and not (longest == 1 and self.deferred is not None and self.paused)):
            # (a paused decode's first pass is deferred: no fc now, the flush runs its own)
            self.proposer.precombine(aux)
        return logits, row_start, aux if self.aux_layer_ids else hidden

    def _logits_fn(self, upcast: bool = True) -> Callable[[torch.Tensor], torch.Tensor]:
        """Logits of target rows: those a graph replay computed with them (the whole replay's
        rows, ``GraphedTarget.logits_for``), else the eager readout (fp32). ``upcast=False``
        keeps a graph's in the model dtype: greedy steps only take their argmax, which the
        upcast cannot change (it is exact), and the upcast of every row (a [T, V] write and a
        read twice the size) is GPU time at batch 64; readers of probabilities upcast."""
        graph_logits = getattr(self.target_fn, "logits_for", None)
        if graph_logits is None:
            return self.model.compute_logits

        def logits(hidden: torch.Tensor) -> torch.Tensor:  # [R, h] -> [R, V]
            out = graph_logits(hidden)
            if out is None:
                return self.model.compute_logits(hidden)
            return out.float() if upcast else out
        return logits

    def _prepare(self, reqs: list[Request], num_new: list[int]
                 ) -> tuple[HostBatch, list[Span], list[int]]:
        """The step's flat batch on the host; draft rows point into the device-resident drafts."""
        if not self._draft_row:  # nothing proposed: no request verifies drafts this step
            return self._prepare_plain(reqs, num_new)
        spans, num_draft, host_ids = [], [], []
        draft_dst, draft_src = [], []
        width = max(self.k, 1)  # drafts per row of the last proposal
        for r, n in zip(reqs, num_new):
            k_i = self.num_drafts_for(r)
            start = r.num_computed
            offset = len(host_ids)
            host_ids.extend(r.tokens(start, start + n))
            host_ids.extend([0] * k_i)  # filled from the device-resident drafts
            src = self._draft_row.get(r.req_id, 0) * width
            draft_dst.extend(range(offset + n, offset + n + k_i))
            draft_src.extend(range(src, src + k_i))
            spans.append(Span(r.req_id, start, n + k_i))
            num_draft.append(k_i)
        hb = build_host_batch(self.allocator, spans, host_ids, draft_dst, draft_src)
        return hb, spans, num_draft

    def _prepare_plain(self, reqs: list[Request], num_new: list[int]
                       ) -> tuple[HostBatch, list[Span], list[int]]:
        """``_prepare`` when nothing was proposed (vanilla decoding above all): no request
        verifies drafts, so the per-request draft bookkeeping is skipped (hot at batch 1000)."""
        spans, host_ids = [], []
        for r, n in zip(reqs, num_new):
            host_ids.extend(r.tokens(r.num_computed, r.num_computed + n))
            spans.append(Span(r.req_id, r.num_computed, n))
        return build_host_batch(self.allocator, spans, host_ids), spans, [0] * len(reqs)

    def _accept(self, reqs: list[Request], logits: torch.Tensor, num_draft: list[int],
                num_new: list[int], row_start: list[int],
                target_hidden: torch.Tensor | list[torch.Tensor], logprobs: bool
                ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None] | None]:
        """Greedy or rejection sampling; one device-to-host copy of the results. With the
        tokens, their logprobs where a request wants them (None: none does)."""
        kmax = logits.shape[1] - 1  # [B, K+1, V]
        greedy = all(r.params.greedy for r in reqs)  # host-known: no sampling tensors needed
        ks = [r.params.logprobs for r in reqs] if logprobs else []
        if kmax == 0:  # a decode step: its token (the argmax, or vanilla's sampled draw)
            tok = (logits[:, 0].argmax(dim=-1) if greedy  # [B]
                   else coupled_targets(self, reqs, logits)[:, 0])
            # Logprobs from the logits before a launch ahead overwrites them, copied ahead of
            # the token's copy (its wait covers both).
            lp_copy = None if not logprobs else self.copy_to_host(device_logprobs(
                logits[:, 0], tok, max(k for k in ks if k is not None)))  # [B, 1 + 2 kmax]
            if self.ahead.enabled and self.k == 0:  # the next decode launched from it first
                toks = self.to_host(self.ahead.decode(reqs, num_new, tok))
            elif self.ahead.enabled and self.paused:
                # ... and with speculation paused, after the draft's first pass run from it
                first = lambda: sync_ahead(self, reqs, num_new, tok, row_start,  # noqa: E731
                                           target_hidden)
                copy = self.ahead.decode(reqs, num_new, tok, first)
                if self.deferred is not None and self.deferred.run_due():
                    self.clock.mark("deferred_flush")  # a full ring's, behind that launch
                toks = self.to_host(copy)
            else:
                toks = self.to_host(tok)
            out = [[t] for t in toks]
            return out, None if lp_copy is None else unpack_logprobs(
                lp_copy.wait().numpy(), [[b] for b in range(len(reqs))], out, ks)
        if greedy:
            out = self._greedy_accept_host(reqs, logits.argmax(dim=-1), num_draft)
        else:
            out = sampled_accept(self, reqs, logits, num_draft)
        # (it upcasts the rows it reads, as apply_filters does: a graph's are the model dtype)
        return out, gather_logprobs(list(logits), out, ks) if logprobs else None

    def _greedy_accept_host(self, reqs: list[Request], target: torch.Tensor,  # [B, K+1]
                            num_draft: list[int]) -> list[list[int]]:
        """Greedy verification: accept drafts while they equal the target's argmax, then the
        target's next token. At most k compares per request, so they run on the host from one
        copy of the argmax and the drafts, not as a dozen tiny kernels on a host-bound step."""
        k1 = target.shape[1]
        width = self._drafts.shape[1]  # [B_prev, k] from the last proposal
        flat = self.to_host(torch.cat([target.reshape(-1), self._drafts.reshape(-1)]))  # one D2H
        drafts = flat[target.numel():]
        out = []
        for i, (r, k_i) in enumerate(zip(reqs, num_draft)):
            base = self._draft_row.get(r.req_id, 0) * width
            out.append(greedy_accept(flat[i * k1:(i + 1) * k1], drafts[base:base + k_i], k_i))
        return out

    @torch.inference_mode()
    def propose(self, reqs: list[Request], accepted: dict[int, int], draft: bool = True) -> None:
        """Draft for the requests that go on, from this step's target hidden states.

        ``accepted`` maps req_id -> drafts accepted this step (0 for prefill rows). A request
        left out (finished, or with no room to verify anything next step) gets no drafts.
        ``draft=False`` (speculation paused): only the draft's first pass runs, keeping its KV
        complete (or, one position per request, it is deferred: engine/deferred_first_pass.py);
        the next step verifies nothing.
        """
        self._draft_row = {}
        pend, early = self._pending, self._early_step
        self._pending = self._early_step = None
        synced, self._synced = self._synced, None  # the first pass was handled ahead
        if early is not None:  # proposed already, before the acceptance was read
            self.early.finish(early, reqs, accepted, draft)
            return
        if self.proposer is None or pend is None or synced == "deferred":
            return  # (deferred ahead: its blocks grown there, its draft KV not yet written)
        by_id = {s.req_id: (s, rs, kd) for s, rs, kd in zip(pend.spans, pend.row_start, pend.num_draft)}
        first_pass, token_ids, hidden_rows, limits, chosen = [], [], [], [], []
        computed: list[int] = []  # each chosen request's draft KV is valid up to here after
        for r in reqs:
            if r.req_id not in by_id or not r.spec_enabled:
                continue
            span, row0, k_d = by_id[r.req_id]
            n_tok = r.num_tokens
            k_next = min(self.k, r.kv_limit - n_tok - 1)
            want = min(n_tok + self.lookahead, self._grow_cap(r))
            try:
                self.allocator.grow(r.req_id, want)
            except KVCacheExhausted:
                have = len(self.allocator.tables.get(r.req_id, ())) * self.allocator.page_size
                k_next = min(k_next, have - n_tok)
            if k_next <= 0:
                continue
            m = span.length - k_d + accepted[r.req_id]  # accepted target positions
            first_pass.append(Span(r.req_id, span.start, m))
            token_ids.extend(r.tokens(span.start + 1, span.start + 1 + m))
            rows = pend.rows_by_req.get(r.req_id) if pend.rows_by_req else None
            hidden_rows.extend(rows[:m] if rows is not None else range(row0, row0 + m))
            limits.append(n_tok - 2 + k_next)
            chosen.append(r)
            computed.append(span.start + m)
        if not chosen:
            return
        batch = ProposeBatch(
            first_pass=first_pass, token_ids=token_ids, hidden_rows=hidden_rows, step_limits=limits,
            temperature=[r.params.temperature for r in chosen], seeds=[r.seed for r in chosen])
        with phase("propose"):
            if (not draft and synced is None and self.deferred is not None
                    and len(hidden_rows) == len(chosen)  # one position per request
                    and self.deferred.defer(chosen, [s.start for s in first_pass], hidden_rows,
                                            pend.hidden) is None):
                return
            if synced is None:
                self.flush_deferred("draft" if draft else "sync")
            for r, c in zip(chosen, computed):  # after the flush, which reads the old value
                r.draft_computed = c  # the first pass writes draft KV up to here
            if draft:
                self._propose(chosen, batch, pend)
            elif synced is None:
                self.proposer.sync(batch, pend.hidden)

    def _grow_cap(self, req: Request) -> int:
        """Positions a proposal may reserve blocks up to (chains never pass kv_limit)."""
        return req.kv_limit

    def _propose(self, chosen: list[Request], batch: ProposeBatch, pend: _Pending) -> None:
        """Draft for ``chosen`` (row i of ``batch``) and keep the drafts for the next step."""
        self._drafts, self._draft_probs = self.proposer.propose(batch, pend.hidden)
        self._draft_row = {r.req_id: i for i, r in enumerate(chosen)}
        self._drafts_k = self.verify_k

