"""The whole propose step as ONE CUDA graph per batch size: the draft's first pass over each
request's accepted positions (<= k + 1 per request), the first draft, and the k - 1 step loop.

Why a dedicated runner rather than ``GraphRunner`` + ``StaticBuffers``: a propose call is small
(at batch 1 the draft's kernels take ~0.3 ms on an H200) and its cost is mostly host work, so
every launched op counts. Here the host writes every integer input, already padded to the
captured size, into one int64 and one int32 host array (numpy views of pinned buffers, no torch
ops); two host->device copies land them in the static buffers the graph reads. Before the
replay only EAGLE-3's fc runs, eagerly, over all of the step's target rows (fc, copy into the
static hidden buffer; the graph gathers the accepted rows): it depends on the target's aux width
and token count, never on the graph (seeds/003). After the replay one clone takes the drafts out
of the graph pool.

Padding rules (as ``capture.pad``): padded tokens have id 0, position 0, slot -1 and belong to
no sequence (query_start_loc repeats the live count); padded sequences have seq_len 0, block
table 0, slot -1 at every loop step. Their drafts are computed from garbage and sliced away.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from capture.cuda_graphs import capture_each, capture_graph
from capture.emulate import emulate_graph
from capture.host_stage import put, put_rows, put_tables, staging
from capture.pad import LiveBatch
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.engine.batch import loop_rows, span_rows

if TYPE_CHECKING:
    from compiled_spec.kv_cache import BlockAllocator
    from compiled_spec.spec.proposer import EagleProposer, ProposeBatch


class _Layout:
    """Named segments of one flat buffer: name -> (offset, length)."""

    def __init__(self, segments: list[tuple[str, int]]) -> None:
        self.at: dict[str, tuple[int, int]] = {}
        off = 0
        for name, n in segments:
            self.at[name] = (off, n)
            off += n
        self.size = off

    def seg(self, buf: Any, name: str, n: int | None = None) -> Any:
        off, length = self.at[name]
        return buf[off:off + (length if n is None else n)]


def stage_dummy(h64: Any, h32: Any, l64: _Layout, l32: _Layout, b: int, q: int) -> None:
    """The host inputs of a capture's dummy run at batch ``b``: ``q`` first-pass rows per
    request at positions 0..q-1, KV slot -1 everywhere (dummy runs never write the live KV
    cache), one loop row per request; every other input 0."""
    t = b * q
    h64[:] = 0
    h32[:] = 0
    l64.seg(h64, "positions", t)[:] = np.arange(t) % q
    l64.seg(h64, "slots", t)[:] = -1
    l32.seg(h32, "seq_lens", b)[:] = q
    l32.seg(h32, "qsl", b + 1)[:] = np.arange(b + 1) * q
    l32.seg(h32, "loop_qsl", b + 1)[:] = np.arange(b + 1)


def stage_first_pass(h64: Any, l64: _Layout, batch: "ProposeBatch", pos: list[int],
                     slots: list[int], t: int) -> None:
    """A first pass's token rows into the int64 host buffer, padded to ``t``: ids, positions,
    KV slots (padding -1: never written) and the target rows each reads."""
    put(l64.seg(h64, "ids"), batch.token_ids, t, 0)
    put(l64.seg(h64, "positions"), pos, t, 0)
    put(l64.seg(h64, "slots"), slots, t, -1)
    put(l64.seg(h64, "rows"), batch.hidden_rows, t, 0)


def stage_tables(h32: Any, l32: _Layout, b: int, w: int, tables: list[list[int]],
                 temperature: list[float]) -> None:
    """Each request's block table (zero-padded to ``w`` blocks) and sampling temperature into
    the int32 host buffer; padded sequences get table 0 and temperature 0."""
    put_tables(l32.seg(h32, "tables", b * w).reshape(b, w), tables)
    temp = l32.seg(h32, "temperature", b).view(np.float32)
    temp[:len(temperature)] = temperature
    temp[len(temperature):] = 0.0


class StepCapture:
    """A runner that captures a whole step of the draft per batch size (the propose graphs, late
    and early, and the first-pass graphs): ``capture()``, every size's ``_capture_one`` under
    inference mode, as the engine replays them, with progress and failures recorded
    (``capture_each``); the GraphRunner-compatible surface (``assert_captured``, stats); the
    upload of its two staging buffers."""

    name: str
    sizes: list[int]
    bucket: int
    strict: bool
    emulate: bool
    device: torch.device
    capture_failures: list[dict[str, Any]]
    _graphs: dict[int, Any]
    t64: torch.Tensor  # pinned host staging -> the static device buffers
    t32: torch.Tensor
    d64: torch.Tensor
    d32: torch.Tensor
    q: int  # first-pass rows per request a graph holds
    hidden: torch.Tensor  # [T_max, h]: the fc output the first pass gathers its rows from
    graph_replays: int = 0
    padded_rows: int = 0
    eager_fallbacks: int = 0
    fallback_reasons: dict[str, int]

    @property
    def enabled(self) -> bool:
        return self.emulate or self.device.type == "cuda"

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def stats(self) -> dict[str, Any]:
        return {"graph_replays": self.graph_replays, "padded_rows": self.padded_rows,
                "eager_fallbacks": self.eager_fallbacks,
                "fallback_reasons": dict(self.fallback_reasons),
                "captured_sizes": self.captured_sizes,
                "captured_graphs": [(b, self.bucket) for b in self.captured_sizes],
                "capture_failures": list(self.capture_failures)}

    def graph_size(self, n: int) -> int | None:
        """The smallest captured size that holds ``n`` requests (None: none does)."""
        return next((s for s in self.sizes if s >= n and s in self._graphs), None)

    def too_long(self, batch: "ProposeBatch") -> bool:
        """Whether a first pass of ``batch`` has more positions than a graph holds per request
        (a prompt's)."""
        return any(s.length > self.q for s in batch.first_pass)

    def _fit(self, batch: "ProposeBatch", target_hidden: torch.Tensor | list[torch.Tensor]
             ) -> int | str:
        """The captured size ``batch`` pads to, or why no graph takes it (nothing staged)."""
        if not self.enabled:
            return "cpu"
        if self.too_long(batch):
            return "prefill"
        b = self.graph_size(len(batch.first_pass))
        if b is None:
            return "size"
        aux = target_hidden[0] if isinstance(target_hidden, list) else target_hidden
        if aux.shape[0] > self.hidden.shape[0]:  # a target step larger than any graph
            return "target_rows"
        return b

    def _rows(self, batch: "ProposeBatch"
              ) -> tuple[list[list[int]], tuple[list[int], list[int], list[int], list[int]]] | str:
        """Each request's block table and its first-pass rows (positions, KV slots, seq_lens,
        query_start_loc); or why they do not fit the captured graphs (a table wider than they
        hold, a sequence past their max_seq_len bucket)."""
        tables = [self.allocator.tables[sp.req_id] for sp in batch.first_pass]
        if max(len(table) for table in tables) > self.max_blocks:
            return "block_table_width"
        rows = span_rows(self.allocator, batch.first_pass)
        if max(rows[2]) > self.bucket:
            return "max_seq_len"
        return tables, rows

    def _miss(self, why: str) -> None:
        self.eager_fallbacks += 1
        self.fallback_reasons[why] = self.fallback_reasons.get(why, 0) + 1

    def _upload(self) -> None:
        self.d64.copy_(self.t64, non_blocking=True)
        self.d32.copy_(self.t32, non_blocking=True)

    def _capture_one(self, b: int) -> None:
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self) -> None:
        if self.enabled:
            capture_each(self.name, self.sizes, self.bucket, self._capture_one,
                         self.capture_failures, self.strict)


class ProposeGraphs(StepCapture):
    name = "draft_propose"

    def __init__(self, proposer: "EagleProposer", allocator: "BlockAllocator",
                 batch_sizes: tuple[int, ...], max_blocks: int, max_seq_len: int,
                 hidden_dtype: torch.dtype, pool: Any = None, emulate: bool = False,
                 strict: bool = False) -> None:
        self.prop, self.allocator = proposer, allocator
        self.k = proposer.k
        self.q = self.k + 1  # first-pass tokens per request (accepted drafts + bonus token)
        self.steps = self.k - 1
        self.sizes = sorted(set(batch_sizes))
        self.max_blocks, self.bucket = max_blocks, max_seq_len
        self.pool, self.emulate, self.strict = pool, emulate, strict
        self.device = proposer.device
        bm, tm, s, w = self.sizes[-1], self.sizes[-1] * self.q, self.steps, max_blocks
        self.l64 = _Layout([("ids", tm), ("positions", tm), ("slots", tm), ("rows", tm),
                            ("last", bm), ("seeds", bm), ("loop_pos", s * bm),
                            ("loop_slots", s * bm)])
        self.l32 = _Layout([("seq_lens", bm), ("qsl", bm + 1), ("tables", bm * w),
                            ("loop_lens", s * bm), ("loop_qsl", bm + 1), ("temperature", bm)])
        # Host buffers (pinned on CUDA; see capture.host_stage.staging for why that is safe).
        self.t64, self.h64 = staging(self.l64.size, torch.int64, self.device)
        self.t32, self.h32 = staging(self.l32.size, torch.int32, self.device)
        # Inference tensors, as everything the graph bodies compute (capture and replay run in
        # inference mode): the compiled draft step guards on its inputs' dispatch keys, and
        # metadata views of normal buffers here beside the early graph's computed metadata
        # made Dynamo compile every draft callable twice (tenth session, TORCH_LOGS=recompiles).
        with torch.inference_mode():
            self.d64 = torch.zeros(self.l64.size, dtype=torch.int64, device=self.device)
            self.d32 = torch.zeros(self.l32.size, dtype=torch.int32, device=self.device)
            # [T_max, h]: the fc output (eager) over ALL of the target's rows of the step; the
            # graph gathers each request's accepted rows itself: the host launches no gathers.
            self.hidden = torch.zeros(tm, proposer.draft.config.hidden_size, dtype=hidden_dtype,
                                      device=self.device)
        self._graphs: dict[int, tuple[Any, Any]] = {}
        self.capture_failures: list[dict[str, Any]] = []
        self.graph_replays = self.padded_rows = self.eager_fallbacks = 0
        self.fallback_reasons: dict[str, int] = {}

    def fc_out(self, rows: int) -> torch.Tensor | None:
        """[rows, h] the graphs' hidden input, where EAGLE-3's fc may write (``precombine``);
        None when a step has more target rows than it holds."""
        return self.hidden[:rows] if rows <= self.hidden.shape[0] else None

    # ---- static views ----------------------------------------------------------------------
    def _views(self, b: int) -> dict[str, Any]:
        t, s, w = b * self.q, self.steps, self.max_blocks
        g64 = lambda name, n=None: self.l64.seg(self.d64, name, n)  # noqa: E731
        g32 = lambda name, n=None: self.l32.seg(self.d32, name, n)  # noqa: E731
        bm = self.sizes[-1]
        return {
            "ids": g64("ids", t), "positions": g64("positions", t), "rows": g64("rows", t),
            "last": g64("last", b), "seeds": g64("seeds", b), "hidden": self.hidden,
            "temperature": g32("temperature", b).view(torch.float32),
            "meta": AttentionMetadata(
                slot_mapping=g64("slots", t), block_tables=g32("tables", b * w).view(b, w),
                seq_lens=g32("seq_lens", b), query_start_loc=g32("qsl", b + 1),
                max_query_len=self.q, max_seq_len=self.bucket),
            "loop_pos": g64("loop_pos").view(s, bm)[:, :b],
            "loop_meta": AttentionMetadata(
                slot_mapping=g64("loop_slots").view(s, bm)[:, :b],
                block_tables=g32("tables", b * w).view(b, w),
                seq_lens=g32("loop_lens").view(s, bm)[:, :b],
                query_start_loc=g32("loop_qsl", b + 1), max_query_len=1,
                max_seq_len=self.bucket),
        }

    def _body(self, v: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The captured computation: first pass, first draft, k-1 loop steps."""
        p = self.prop
        metas = {n: v["meta"] for n in p.layer_names}
        hidden = v["hidden"].index_select(0, v["rows"])  # [T, h] accepted target rows
        feed, for_logits = p.step_fn(v["ids"], hidden, v["positions"], metas)  # [T, h]
        last = v["last"]
        feed = feed[last]  # [b, h]
        tok, q = p.picker.pick(p.draft.compute_logits(for_logits[last]), v["temperature"],
                               v["seeds"], v["positions"][last] + 2)
        if self.steps == 0:
            return tok[:, None], (q[:, None] if p.sample_drafts else None)
        rest, rest_q = p.run_loop(LiveBatch(
            input_ids=tok, positions=v["loop_pos"], meta=v["loop_meta"],
            extras={"feed": feed, "temperature": v["temperature"], "seeds": v["seeds"]}))
        drafts = torch.cat([tok[:, None], rest], dim=1)  # [b, k]
        return drafts, (torch.cat([q[:, None], rest_q], dim=1) if p.sample_drafts else None)

    # ---- start-up ----------------------------------------------------------------------------
    def _capture_one(self, b: int) -> None:
        h64, h32, l64, l32, q = self.h64, self.h32, self.l64, self.l32, self.q
        stage_dummy(h64, h32, l64, l32, b, q)
        l64.seg(h64, "last", b)[:] = np.arange(1, b + 1) * q - 1
        l64.seg(h64, "loop_slots")[:] = -1
        l32.seg(h32, "loop_lens")[:] = 1
        self._upload()
        views = self._views(b)
        run = lambda: self._body(views)  # noqa: E731
        self._graphs[b] = (emulate_graph(run, self.pool) if self.emulate
                           else capture_graph(run, self.pool))

    # ---- per propose -------------------------------------------------------------------------
    def _stage(self, batch: "ProposeBatch", target_hidden: torch.Tensor | list[torch.Tensor]
               ) -> int | str:
        """Stage ``batch`` for a replay: the captured size it pads to, its inputs uploaded and
        the fc output in the static hidden buffer (the replay that follows is counted here); or
        the reason no graph fits."""
        b = self._fit(batch, target_hidden)
        if isinstance(b, str):
            return b
        why = self._fill(batch, b)
        if why is not None:
            return why
        # EAGLE-3's fc, eager and outside the graph, over every target row of the step:
        # [T_target, n*h_target] -> [T_target, h] (EAGLE-1: the final hidden, as it is);
        # usually issued already, right after the verify (EagleProposer.precombine).
        hidden = self.prop.combine(target_hidden)
        put_rows(self.hidden, hidden)  # no launch when precombine wrote it there (fc_out)
        self.graph_replays += 1
        self.padded_rows += b - len(batch.first_pass)
        return b

    @torch.inference_mode()  # writes the inference-tensor buffers (see __init__)
    def run(self, batch: "ProposeBatch", target_hidden: torch.Tensor | list[torch.Tensor]
            ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Replay for ``batch`` and return (drafts [n, k], q or None); None (counted) when no
        captured graph fits, so the caller runs the uncaptured path."""
        b = self._stage(batch, target_hidden)
        if isinstance(b, str):
            self._miss(b)
            return None
        graph, (drafts, probs) = self._graphs[b]
        graph.replay()
        n = len(batch.first_pass)
        return drafts[:n].clone(), (probs[:n].clone() if probs is not None else None)

    def _fill(self, batch: "ProposeBatch", b: int) -> str | None:
        """Write the padded inputs on the host and upload them; a reason string when they do
        not fit the captured graph."""
        q, s, w = self.q, self.steps, self.max_blocks
        t = b * q
        fit = self._rows(batch)
        if isinstance(fit, str):
            return fit
        tables, (pos, slots, lens, qsl) = fit
        last = [end - 1 for end in qsl[1:]]
        loop_pos, loop_slots, loop_lens = loop_rows(self.allocator, batch.first_pass,
                                                    batch.step_limits, s)
        if s and max(max(r) for r in loop_lens) > self.bucket:
            return "max_seq_len"
        n, t_live = len(batch.first_pass), len(pos)
        h64, h32, l64, l32 = self.h64, self.h32, self.l64, self.l32
        stage_first_pass(h64, l64, batch, pos, slots, t)
        put(l64.seg(h64, "last"), last, b, 0)
        put(l64.seg(h64, "seeds"), batch.seeds, b, 0)
        bm = self.sizes[-1]
        if s:  # padded sequences: position 0, slot -1 (no write), seq_len 0
            for name, arr, live, pad in (("loop_pos", h64, loop_pos, 0),
                                         ("loop_slots", h64, loop_slots, -1),
                                         ("loop_lens", h32, loop_lens, 0)):
                grid = (l64 if arr is h64 else l32).seg(arr, name).reshape(s, bm)
                grid[:, :n] = live
                grid[:, n:b] = pad
        put(l32.seg(h32, "seq_lens"), lens, b, 0)
        put(l32.seg(h32, "qsl"), qsl, b + 1, t_live)
        stage_tables(h32, l32, b, w, tables, batch.temperature)
        put(l32.seg(h32, "loop_qsl"), list(range(n + 1)), b + 1, n)
        self._upload()
        return None

