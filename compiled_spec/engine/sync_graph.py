"""The draft's first pass alone as one CUDA graph per batch size (issue 16): what an engine whose
adaptive policy pauses drafting replays to keep the draft's KV complete, for a paused step's
one position per request (``engine.paused_ahead``) or a flush of many
(``engine.deferred_first_pass``: up to ``rows`` positions per request).

Why a runner of its own, apart from the propose graphs (engine/propose_graph.py, which
captured these graphs until the forty-third session): a flush may come at any point of a step,
and on the propose graphs' resources it could not. Their memory pool is the target's, so a
replay could reuse the blocks of a target forward's outputs not read yet; their pinned staging
buffers may be rewritten once per step only (capture.host_stage.staging), and the step's
proposal stages into them too; their hidden input holds the fc output that the step's own
proposal reads (``EagleProposer.precombine``). So flushes that came before a step's launched
verify was read (a change to drafting, a prompt chunk, a reset) ran eagerly: at batch 64 on
the H100 such a flush of 32 positions per request took up to ~14 ms of a 1 ms step. Here the
graphs have their own pool, staging and hidden buffers: every flush that fits replays.

Padding as ``capture.pad``: padded tokens have id 0, position 0, slot -1 (their KV is never
written) and belong to no sequence; padded sequences have seq_len 0 and block table 0.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from capture.cuda_graphs import capture_graph
from capture.emulate import emulate_graph
from capture.host_stage import put, put_rows, put_tables, staging
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.engine.propose_graph import StepCapture, _Layout, stage_first_pass

if TYPE_CHECKING:
    from compiled_spec.kv_cache import BlockAllocator
    from compiled_spec.spec.propose_batch import ProposeBatch
    from compiled_spec.spec.proposer import EagleProposer


class SyncGraphs(StepCapture):
    name = "draft_sync"

    def __init__(self, proposer: "EagleProposer", allocator: "BlockAllocator",
                 batch_sizes: tuple[int, ...], rows: int, max_blocks: int, max_seq_len: int,
                 hidden_dtype: torch.dtype, emulate: bool = False, strict: bool = False) -> None:
        self.prop, self.allocator = proposer, allocator
        self.q = rows  # first-pass positions per request a graph holds
        self.sizes = sorted(set(batch_sizes))
        self.max_blocks, self.bucket = max_blocks, max_seq_len
        self.emulate, self.strict = emulate, strict
        self.device = proposer.device
        # A pool of their own (see the module docstring); off CUDA a token stands for it.
        self.pool = (torch.cuda.graph_pool_handle() if self.device.type == "cuda" and not emulate
                     else object())
        bm, w = self.sizes[-1], max_blocks
        tm = bm * rows
        self.l64 = _Layout([("ids", tm), ("positions", tm), ("slots", tm), ("rows", tm)])
        self.l32 = _Layout([("seq_lens", bm), ("qsl", bm + 1), ("tables", bm * w)])
        # Two sets of pinned staging buffers, used in turn: a pinned buffer may be rewritten
        # only once its upload has run, which the step's device-to-host read orders for the
        # step's own uploads (capture.host_stage.staging); a full ring's flush comes after the
        # paused step's read was issued, and the next step may flush again (a change to
        # drafting) before its own read.
        self._stage_sets = [(staging(self.l64.size, torch.int64, self.device),
                             staging(self.l32.size, torch.int32, self.device)) for _ in range(2)]
        self._turn = 0
        self._use(0)
        with torch.inference_mode():  # as the propose graphs' buffers (see there)
            self.d64 = torch.zeros(self.l64.size, dtype=torch.int64, device=self.device)
            self.d32 = torch.zeros(self.l32.size, dtype=torch.int32, device=self.device)
            # [T_max, h]: the fc output over the rows the first pass reads (gathered by the
            # graph through ``rows``)
            self.hidden = torch.zeros(tm, proposer.draft.config.hidden_size, dtype=hidden_dtype,
                                      device=self.device)
        self._graphs: dict[int, Any] = {}
        self.capture_failures: list[dict[str, Any]] = []
        self.graph_replays = self.padded_rows = self.eager_fallbacks = 0
        self.fallback_reasons: dict[str, int] = {}

    def stats(self) -> dict[str, Any]:
        return super().stats() | {"rows_per_request": self.q}

    # ---- start-up ----------------------------------------------------------------------------
    def _views(self, b: int) -> dict[str, Any]:
        t, w = b * self.q, self.max_blocks
        g64 = lambda name: self.l64.seg(self.d64, name, t)  # noqa: E731
        g32 = lambda name, n: self.l32.seg(self.d32, name, n)  # noqa: E731
        return {"ids": g64("ids"), "positions": g64("positions"), "rows": g64("rows"),
                "meta": AttentionMetadata(
                    slot_mapping=g64("slots"), block_tables=g32("tables", b * w).view(b, w),
                    seq_lens=g32("seq_lens", b), query_start_loc=g32("qsl", b + 1),
                    max_query_len=self.q, max_seq_len=self.bucket)}

    def _body(self, v: dict[str, Any]) -> None:
        """The first pass over the staged positions: its KV writes are the point."""
        p = self.prop
        hidden = self.hidden.index_select(0, v["rows"])  # [T, h]
        p.step_fn(v["ids"], hidden, v["positions"], {n: v["meta"] for n in p.layer_names})

    def _capture_one(self, b: int) -> None:
        """A dummy run's inputs: ``q`` rows per request at positions 0..q-1, slot -1 (the live
        KV cache is never written), then the capture."""
        t, q = b * self.q, self.q
        self.h64[:] = 0
        self.h32[:] = 0
        self.l64.seg(self.h64, "positions", t)[:] = np.arange(t) % q
        self.l64.seg(self.h64, "slots", t)[:] = -1
        self.l32.seg(self.h32, "seq_lens", b)[:] = q
        self.l32.seg(self.h32, "qsl", b + 1)[:] = np.arange(b + 1) * q
        self._upload()
        views = self._views(b)
        run = lambda: self._body(views)  # noqa: E731
        self._graphs[b] = (emulate_graph(run, self.pool) if self.emulate
                           else capture_graph(run, self.pool))[0]

    def _use(self, i: int) -> None:
        ((self.t64, self.h64), (self.t32, self.h32)) = self._stage_sets[i]

    # ---- per call ----------------------------------------------------------------------------
    @torch.inference_mode()  # writes the inference-tensor buffers
    def run(self, batch: "ProposeBatch", target_hidden: torch.Tensor | list[torch.Tensor],
            ids: torch.Tensor | None = None,  # [n] on the device: the first pass's tokens
            ) -> bool:
        """Replay the first pass for ``batch`` (its positions' KV written); False (counted)
        when no captured graph fits, so the caller runs it uncaptured. ``ids``: one token per
        request taken from the device in place of ``batch.token_ids`` (a paused step launched
        ahead, engine/paused_ahead.py: its tokens are not on the host yet)."""
        why = self._stage(batch, target_hidden)
        if isinstance(why, str):
            # (no graph at all for this call: said as a paused first pass; a prompt's first
            # pass is "prefill" in either mode, no graph takes its length)
            self._miss("paused (first pass only)" if why in ("cpu", "size") else why)
            return False
        if ids is not None:  # behind the upload on the stream: it overwrites the staged ids
            self.l64.seg(self.d64, "ids", ids.shape[0]).copy_(ids)
        self._graphs[why].replay()
        return True

    def _stage(self, batch: "ProposeBatch", target_hidden: torch.Tensor | list[torch.Tensor]
               ) -> int | str:
        """The captured size ``batch`` pads to, its inputs uploaded and its rows' fc output in
        the hidden buffer; or the reason no graph fits."""
        b = self._fit(batch, target_hidden)
        if isinstance(b, str):
            return b
        n, q, w = len(batch.first_pass), self.q, self.max_blocks
        aux = target_hidden if isinstance(target_hidden, list) else [target_hidden]
        fit = self._rows(batch)
        if isinstance(fit, str):
            return fit
        tables, (pos, slots, lens, qsl) = fit
        t = b * q
        self._turn ^= 1
        self._use(self._turn)
        h64, h32, l64, l32 = self.h64, self.h32, self.l64, self.l32
        stage_first_pass(h64, l64, batch, pos, slots, t)
        put(l32.seg(h32, "seq_lens"), lens, b, 0)
        put(l32.seg(h32, "qsl"), qsl, b + 1, len(pos))
        put_tables(l32.seg(h32, "tables", b * w).reshape(b, w), tables)
        self._upload()
        # EAGLE-3's fc over the step's target rows ([T, n*h_target] -> [T, h]), eager, into
        # this runner's own buffer (EAGLE-1: the final hidden, as it is)
        put_rows(self.hidden, self.prop.draft.combine_aux(aux, self.hidden[:aux[0].shape[0]]))
        self.graph_replays += 1
        self.padded_rows += b - n
        return b
