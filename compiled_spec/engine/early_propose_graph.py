"""The propose graph of a chain step whose acceptance is still on the device (early propose).

``ProposeGraphs`` needs each request's accepted count on the host: it stages the first pass over
exactly the accepted positions. Here the propose is launched BEFORE the host reads the step's
acceptance, so the draft runs on the GPU while the host does the step's bookkeeping (vLLM's
async scheduling with a padded drafter batch, SGLang's overlap scheduler). The host stages every
request's k + 1 verified positions as if all were accepted, and the graph itself decides from the
target's argmax and the drafts that were verified:

* n_acc [B] = leading drafts equal to the argmax (greedy verification, as the host does it);
  m = n_acc + 1 accepted target positions.
* first pass: a FIXED stride of k + 1 query rows per request (row j at position start + j,
  token argmax[j], seq_len start + k + 1). Rows j >= m get slot -1: they write no KV, and under
  the causal mask a live row j attends keys <= start + j only, all written by rows <= j. Rows
  >= m compute garbage that nothing reads. ``last`` = b * (k + 1) + m - 1.
* loop step s (1..k-1): position start + m - 1 + s, live below the request's limit
  n_tok - 2 + k_next (as ``ModelRunner.propose``: n_tok = start + 1 + m, k_next = min(k,
  max_total - n_tok - 1)); its slot is looked up in the staged block table on the device.

Every request's blocks must already cover the worst case (all k accepted): the caller grows them.
Padded sequences: slots -1, q_len 0 in both passes (as ``capture.pad``), seq_len 0 in the loop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from capture.cuda_graphs import capture_graph
from capture.emulate import emulate_graph
from capture.host_stage import put, put_rows, staging
from capture.pad import LiveBatch
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.engine.batch import chain_rows
from compiled_spec.engine.propose_graph import StepCapture, _Layout, stage_dummy, stage_tables

if TYPE_CHECKING:
    from compiled_spec.engine.propose_graph import ProposeGraphs


class EarlyGraphSurface(StepCapture):
    """The GraphRunner-compatible surface (``assert_captured``, stats) of an early graph, chain
    or tree. Steps that could not take it ran the late graphs; the early path counts why, so
    it reports no fallbacks of its own (``fallback_reasons`` stays empty)."""


class EarlyProposeGraphs(EarlyGraphSurface):
    name = "draft_propose_early"

    def __init__(self, base: "ProposeGraphs") -> None:
        # The late graphs' proposer, sizes, pool and fc output buffer are shared: one step
        # replays one of the two, never both.
        self.base, self.prop = base, base.prop
        self.k, self.q, self.steps = base.k, base.q, base.steps
        self.sizes, self.bucket, self.max_blocks = base.sizes, base.bucket, base.max_blocks
        self.page = base.allocator.page_size
        self.device = base.device
        bm, tm, w, k = self.sizes[-1], self.sizes[-1] * self.q, self.max_blocks, self.k
        # "rows" first: every tensor the draft callables take sits at a storage offset >= 2, as
        # the late graphs' views do (see _out below).
        self.l64 = _Layout([("rows", tm), ("positions", tm), ("slots", tm), ("draft_rows", bm),
                            ("start", bm), ("max_total", bm), ("seeds", bm)])
        self.l32 = _Layout([("seq_lens", bm), ("qsl", bm + 1), ("tables", bm * w),
                            ("loop_qsl", bm + 1), ("live", bm), ("temperature", bm)])
        self.t64, self.h64 = staging(self.l64.size, torch.int64, self.device)
        self.t32, self.h32 = staging(self.l32.size, torch.int32, self.device)
        with torch.inference_mode():  # as propose_graph's buffers (one draft compile, not two)
            self.d64 = torch.zeros(self.l64.size, dtype=torch.int64, device=self.device)
            self.d32 = torch.zeros(self.l32.size, dtype=torch.int32, device=self.device)
            # [bm, 2k + 1]: per request the target's argmax over its k + 1 verified rows, then
            # the k drafts it verified; written before the replay, read by it, copied to host.
            # The replay then writes its own drafts into acc[:, k + 1:], out of the graph pool
            # and where the next step reads them: neither a copy out of the pool nor the next
            # step's copy back in (two eager launches a step on the host's path).
            self.acc = torch.zeros(bm, 2 * k + 1, dtype=torch.int64, device=self.device)
            self._j = torch.arange(self.q, device=self.device)  # [k+1] row in a request's stride
            self._row0 = torch.arange(bm, device=self.device) * self.q  # [bm] first row each
            self._neg1 = torch.full((), -1, dtype=torch.int64, device=self.device)
            # What the graph computes for the draft callables is written (out=) at offset >= 2
            # of these: Dynamo guards a tensor input's storage offset (0 and 1 specialize), and
            # the late graphs' metadata are views at offsets >= 2, so fresh tensors here made it
            # compile the draft step and the step + pick twice each (tenth session).
            s = max(self.steps, 0)
            self._o64 = torch.zeros(2 + tm + 2 * s * bm, dtype=torch.int64, device=self.device)
            self._o32 = torch.zeros(2 + s * bm, dtype=torch.int32, device=self.device)
        self.acc_host, _ = staging(bm * (2 * k + 1), torch.int64, self.device)
        self._drafts_views: dict[int, torch.Tensor] = {}  # n -> acc[:n, k + 1:]
        self._target_views: dict[int, torch.Tensor] = {}  # n -> acc[:n, :k + 1]
        self._graphs: dict[int, tuple[Any, Any]] = {}
        self.capture_failures: list[dict[str, Any]] = []
        self.graph_replays = self.padded_rows = 0
        self.fallback_reasons: dict[str, int] = {}

    # ---- GraphRunner-compatible surface ----------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.base.enabled

    @property
    def strict(self) -> bool:  # type: ignore[override]
        return self.base.strict

    # ---- the captured computation ------------------------------------------------------------
    def _views(self, b: int) -> dict[str, Any]:
        t, w, tm, bm = b * self.q, self.max_blocks, self.sizes[-1] * self.q, self.sizes[-1]
        s = max(self.steps, 0)
        g64 = lambda name, n: self.l64.seg(self.d64, name, n)  # noqa: E731
        g32 = lambda name, n: self.l32.seg(self.d32, name, n)  # noqa: E731
        return {"b": b, "positions": g64("positions", t), "slots": g64("slots", t),
                "rows": g64("rows", t), "start": g64("start", b),
                "max_total": g64("max_total", b), "seeds": g64("seeds", b),
                "seq_lens": g32("seq_lens", b), "qsl": g32("qsl", b + 1),
                "tables": g32("tables", b * w).view(b, w), "loop_qsl": g32("loop_qsl", b + 1),
                "live": g32("live", b), "acc": self.acc[:b],
                # outputs (offsets >= 2): the first pass's slots, the loop's metadata [k-1, b]
                "first_slots": self._o64[2:2 + t],
                "loop_pos": self._o64[2 + tm:2 + tm + s * bm].view(s, bm)[:, :b],
                "loop_slots": self._o64[2 + tm + s * bm:].view(s, bm)[:, :b],
                "loop_lens": self._o32[2:].view(s, bm)[:, :b],
                "temperature": g32("temperature", b).view(torch.float32)}

    def _body(self, v: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        p, k, q, b = self.prop, self.k, self.q, v["b"]
        target, verified = v["acc"][:, :q], v["acc"][:, q:]  # [b, k+1], [b, k]
        # int64 before the scan: a bool cumprod relies on the op promoting it on every backend
        n_acc = (verified == target[:, :k]).long().cumprod(dim=1).sum(dim=1)  # [b]
        m = n_acc + 1  # [b] accepted target positions
        live_row = (self._j[None, :] < m[:, None]).reshape(-1)  # [b*(k+1)]
        tables = v["tables"]  # [b, W]
        first_slots = torch.where(live_row, v["slots"], self._neg1, out=v["first_slots"])
        meta = AttentionMetadata(
            slot_mapping=first_slots, block_tables=tables,
            seq_lens=v["seq_lens"], query_start_loc=v["qsl"], max_query_len=q,
            max_seq_len=self.bucket)
        hidden = self.base.hidden.index_select(0, v["rows"])  # [b*(k+1), h]
        feed, for_logits = p.step_fn(target.reshape(-1), hidden, v["positions"],
                                     {n: meta for n in p.layer_names})  # [b*(k+1), h] each
        last = self._row0[:b] + m - 1  # [b] the row each request's chain continues from
        if self.steps == 0:
            tok, pq = p.picker.pick(p.draft.compute_logits(for_logits[last]),
                                    v["temperature"], v["seeds"], v["positions"][last] + 2)
            v["acc"][:, q:].copy_(tok[:, None])  # as below
            return tok[:, None], (pq[:, None] if p.sample_drafts else None)
        # The pick and the loop's metadata: one compiled callable (compile=True); the loop's
        # buffers are the graph's own (the step graphs were compiled for them).
        tok, pq, feed_last, pos, slots, lens = p.pick_plan_fn(
            for_logits, v["positions"], last, feed, v["temperature"], v["seeds"], v["start"],
            v["live"], m, v["max_total"], tables, self.page, self.max_blocks)
        pos = v["loop_pos"].copy_(pos)  # [k-1, b]
        slots = v["loop_slots"].copy_(slots)
        lens = v["loop_lens"].copy_(lens)  # int32
        rest, rest_q = p.run_loop(LiveBatch(
            input_ids=tok, positions=pos,
            meta=AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=lens,
                                   query_start_loc=v["loop_qsl"], max_query_len=1,
                                   max_seq_len=self.bucket),
            extras={"feed": feed_last, "temperature": v["temperature"], "seeds": v["seeds"]}))
        drafts = torch.cat([tok[:, None], rest], dim=1)  # [b, k]
        v["acc"][:, q:].copy_(drafts)  # acc was read above; the step's host copy came before
        return drafts, (torch.cat([pq[:, None], rest_q], dim=1) if p.sample_drafts else None)

    # ---- start-up ----------------------------------------------------------------------------
    def _capture_one(self, b: int) -> None:
        h64, h32, l64, l32, q = self.h64, self.h32, self.l64, self.l32, self.q
        # max_total 0: no loop step is below its limit, so the loop writes nothing either.
        stage_dummy(h64, h32, l64, l32, b, q)
        l32.seg(h32, "live", b)[:] = 1
        self._upload()
        self.acc.zero_()
        views = self._views(b)
        run = lambda: self._body(views)  # noqa: E731
        self._graphs[b] = (emulate_graph(run, self.base.pool) if self.base.emulate
                           else capture_graph(run, self.base.pool))

    # ---- per step ----------------------------------------------------------------------------
    @torch.inference_mode()  # writes the inference-tensor buffers (see __init__)
    def stage(self, b: int, req_ids: list[int], starts: list[int], row_start: list[int],
              draft_rows: list[int], max_total: list[int], seeds: list[int],
              temperature: list[float]) -> str | None:
        """Write the padded inputs of a graph of size ``b`` on the host and upload them (before
        the acceptance kernels, which read ``draft_rows``). Per request: its k + 1 verified
        positions from ``starts`` (as if all were accepted), ``row_start`` its first target
        row. A reason when they do not fit."""
        n, q, w = len(req_ids), self.q, self.max_blocks
        t = b * q
        alloc = self.base.allocator
        tables = [alloc.tables[r] for r in req_ids]
        if max(map(len, tables)) > w:
            return "block_table_width"
        if max(starts) + q > self.bucket or max(max_total) > self.bucket:
            return "max_seq_len"
        # [n*(k+1)] x2, [n]
        pos, slots, lens = chain_rows(tables, alloc.page_size, starts, None, q)
        rows = (np.asarray(row_start, dtype=np.int64)[:, None] + np.arange(q)).reshape(-1)
        qsl = range(0, n * q + 1, q)
        h64, h32, l64, l32 = self.h64, self.h32, self.l64, self.l32
        put(l64.seg(h64, "positions"), pos, t, 0)
        put(l64.seg(h64, "slots"), slots, t, -1)
        put(l64.seg(h64, "rows"), rows, t, 0)
        put(l64.seg(h64, "draft_rows"), draft_rows, n, 0)
        put(l64.seg(h64, "start"), starts, b, 0)
        put(l64.seg(h64, "max_total"), max_total, b, 0)
        put(l64.seg(h64, "seeds"), seeds, b, 0)
        put(l32.seg(h32, "seq_lens"), lens, b, 0)
        put(l32.seg(h32, "qsl"), qsl, b + 1, n * q)
        put(l32.seg(h32, "loop_qsl"), range(n + 1), b + 1, n)
        put(l32.seg(h32, "live"), [1] * n, b, 0)
        stage_tables(h32, l32, b, w, tables, temperature)
        self._upload()
        return None

    def draft_rows(self, n: int) -> torch.Tensor:
        """[n] the staged rows of the last proposal's drafts, on the device."""
        return self.l64.seg(self.d64, "draft_rows", n)

    @torch.inference_mode()  # writes the inference-tensor buffers (see __init__)
    def replay(self, b: int, n: int, target_hidden: torch.Tensor | list[torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After ``acc`` [:n] is written: the fc output into the static hidden buffer, the
        replay, and (drafts [n, k] in ``acc`` (``drafts``), q [n, k, V] copied out of the
        graph pool, or None)."""
        hidden = self.prop.combine(target_hidden)  # [T_target, h], usually precombined
        put_rows(self.base.hidden, hidden)  # in place already when precombined (fc_out)
        graph, (_, probs) = self._graphs[b]
        graph.replay()
        self.graph_replays += 1
        self.padded_rows += b - n
        return self.drafts(n), (probs[:n].clone() if probs is not None else None)

    def drafts(self, n: int) -> torch.Tensor:
        """[n, k] the last replay's drafts: a view of acc (rows strided), the same object
        for every n (a view is an op on the host's path), valid until the next replay."""
        d = self._drafts_views.get(n)
        if d is None:
            d = self._drafts_views[n] = self.acc[:n, self.q:]
        return d

    def target(self, n: int) -> torch.Tensor:
        """[n, k + 1] the plane of acc the step's argmax is written into."""
        t = self._target_views.get(n)
        if t is None:
            t = self._target_views[n] = self.acc[:n, :self.q]
        return t

    def holds_drafts(self, drafts: torch.Tensor) -> bool:
        """Whether ``drafts`` [n, k] are the last replay's, in place (rows 0..n-1 of acc)."""
        mine = self.acc[:, self.q:]
        return drafts.data_ptr() == mine.data_ptr() and drafts.stride() == mine.stride()
