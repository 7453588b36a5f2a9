"""The draft-tree proposal of a step whose acceptance is still on the device (early tree
propose, issue 15): one graph of the first pass and the expansion, replayed right after the
tree verify, before the host reads the acceptance.

The late path (``TreeProposer.propose``) stages the first pass over exactly the accepted path
and the expansion from the new root, both from host lists. Here the host stages only what does
not depend on acceptance, and the graph decides the rest from the verified trees and the
target's argmax per node (``spec.tree_accept_device``):

* first pass: a FIXED stride of D + 1 query rows per request (row j at position start + j,
  seq_len start + D + 1, causal). Row j <= n_acc reads the accepted node of depth j + 1's token
  (then the bonus) and the target state of its node (the root, then the accepted nodes), as the
  late path stages them; rows past n_acc get slot -1: they write no KV, and a live row attends
  keys <= its own position only, all written by live rows. ``last`` = b * (D + 1) + n_acc.
* expansion: root = start + n_acc + 1 (the new last token's position); step s's K nodes at
  position root + s, KV at tree slots root + s * K + i, seq_len root + F: the slots are looked
  up in the staged block tables on the device, and positions past the request's blocks write
  nothing (as ``TreeProposer._expand_rows``).

Blocks must cover the worst case (all D accepted) beforehand: the caller grows them. Padded
sequences: n_acc 0, q_len 0 in both passes (as ``capture.pad``), slot -1, seq_len 0.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from capture.cuda_graphs import capture_each, capture_graph
from capture.emulate import emulate_graph
from capture.host_stage import put, staging
from capture.pad import LiveBatch
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.engine.propose_graph import _Layout
from compiled_spec.spec.tree_accept_device import accept_greedy_device, first_pass_rows

if TYPE_CHECKING:
    from compiled_spec.kv_cache import BlockAllocator
    from compiled_spec.spec.tree_proposer import TreeProposer


class EarlyTreeGraphs:
    name = "tree_draft_early"

    def __init__(self, prop: "TreeProposer", allocator: "BlockAllocator",
                 batch_sizes: tuple[int, ...], max_blocks: int, bucket: int,
                 dtype: torch.dtype, pool: Any = None, emulate: bool = False,
                 strict: bool = False) -> None:
        cfg = prop.cfg
        self.prop, self.allocator, self.device = prop, allocator, prop.device
        self.d, self.n, self.k = cfg.num_steps, cfg.num_draft_tokens, cfg.topk
        self.q, self.s, self.f = cfg.num_steps + 1, prop.expand_steps, cfg.num_forwarded
        self.sizes, self.bucket, self.max_blocks = sorted(batch_sizes), bucket, max_blocks
        self.page = allocator.page_size
        self.pool, self.emulate, self.strict = pool, emulate, strict
        bm, w = self.sizes[-1], max_blocks
        tm = bm * self.q
        self.l64 = _Layout([("positions", tm), ("slots", tm), ("row0", bm), ("start", bm),
                            ("covered", bm)])
        self.l32 = _Layout([("seq_lens", bm), ("qsl", bm + 1), ("tables", bm * w),
                            ("eqsl", bm + 1), ("live", bm)])
        self.t64, self.h64 = staging(self.l64.size, torch.int64, self.device)
        self.t32, self.h32 = staging(self.l32.size, torch.int32, self.device)
        h = prop.draft.config.hidden_size
        with torch.inference_mode():  # the graphs compute under inference mode
            self.d64 = torch.zeros(self.l64.size, dtype=torch.int64, device=self.device)
            self.d32 = torch.zeros(self.l32.size, dtype=torch.int32, device=self.device)
            # [bm, 4, N] per request: its verified tree's tokens, parents, depths and the
            # target's argmax at each node; written after the verify, read by the replay, and
            # the step's one copy to the host (the host's acceptance reads the same numbers).
            self.acc = torch.zeros(bm, 4, self.n, dtype=torch.int64, device=self.device)
            self.hidden = torch.zeros(bm * self.n, h, dtype=dtype, device=self.device)  # fc rows
            self._row0q = torch.arange(bm, device=self.device) * self.q  # [bm]
            self._step = torch.arange(self.s, device=self.device)  # [S]
            self._node = torch.arange(self.k, device=self.device)  # [K]
        self.acc_host, _ = staging(bm * 4 * self.n, torch.int64, self.device)
        self._graphs: dict[int, tuple[Any, Any]] = {}
        self.capture_failures: list[dict[str, Any]] = []
        self.graph_replays = self.padded_rows = 0

    # ---- GraphRunner-compatible surface ----------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.emulate or self.device.type == "cuda"

    @property
    def captured_sizes(self) -> list[int]:
        return sorted(self._graphs)

    def stats(self) -> dict[str, Any]:
        # Steps that could not take this graph ran the late graphs: EarlyTree counts why.
        return {"graph_replays": self.graph_replays, "padded_rows": self.padded_rows,
                "eager_fallbacks": 0, "fallback_reasons": {},
                "captured_sizes": self.captured_sizes,
                "captured_graphs": [(b, self.bucket) for b in self.captured_sizes],
                "capture_failures": list(self.capture_failures)}

    def graph_size(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n and s in self._graphs), None)

    # ---- the captured computation ------------------------------------------------------------
    def _body(self, b: int) -> tuple[torch.Tensor, ...]:
        p, q, w = self.prop, self.q, self.max_blocks
        g64 = lambda name, n: self.l64.seg(self.d64, name, n)  # noqa: E731
        g32 = lambda name, n: self.l32.seg(self.d32, name, n)  # noqa: E731
        tables = g32("tables", b * w).view(b, w)  # [b, W]
        live = g32("live", b) != 0  # [b]
        tok, par, dep, drawn = self.acc[:b].unbind(1)  # [b, N] each
        path, n_acc, bonus = accept_greedy_device(tok, par, dep, drawn, self.d, live)
        ids, nodes, live_rows = first_pass_rows(tok, path, n_acc, bonus)  # [b, D+1] each
        rows = (g64("row0", b)[:, None] + nodes).reshape(-1)  # [b*(D+1)]
        slots = torch.where(live_rows.reshape(-1), g64("slots", b * q), -1)  # [b*(D+1)]
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                                 seq_lens=g32("seq_lens", b), query_start_loc=g32("qsl", b + 1),
                                 max_query_len=q, max_seq_len=self.bucket)
        feed, for_logits = p.step_fn(ids.reshape(-1), self.hidden.index_select(0, rows),
                                     g64("positions", b * q),
                                     {name: meta for name in p.layer_names})  # [b*(D+1), h]
        last = self._row0q[:b] + n_acc  # [b] each request's row of its new last token
        # The expansion's metadata from the device's root (TreeProposer._expand_rows' rule).
        root = g64("start", b) + n_acc + 1  # [b]
        S, K = self.s, self.k
        pos = (root[None, :, None] + self._step[:, None, None]).expand(S, b, K)  # [S, b, K]
        slot_pos = root[None, :, None] + self._step[:, None, None] * K + self._node  # [S, b, K]
        col = (slot_pos // self.page).clamp(max=w - 1)
        block = tables.long().gather(1, col.permute(1, 0, 2).reshape(b, S * K))  # [b, S*K]
        block = block.view(b, S, K).permute(1, 0, 2)  # [S, b, K]
        writes = (slot_pos < g64("covered", b)[None, :, None]) & live[None, :, None]
        e_slots = torch.where(writes, block * self.page + slot_pos % self.page, -1)
        lens = torch.where(live, root + self.f, 0).to(torch.int32)[None, :].expand(S, b)
        e_meta = AttentionMetadata(slot_mapping=e_slots.reshape(S, b * K), block_tables=tables,
                                   seq_lens=lens.contiguous(),
                                   query_start_loc=g32("eqsl", b + 1), max_query_len=K,
                                   max_seq_len=self.bucket)
        e_ids = torch.zeros(b * K, dtype=torch.int64, device=self.device)  # unused: sizes it
        return p.expand(LiveBatch(e_ids, pos.reshape(S, b * K).contiguous(), e_meta,
                                  extras={"feed": feed[last], "for_logits": for_logits[last]}))

    # ---- start-up ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        if not self.enabled:
            return
        capture_each(self.name, self.sizes, self.bucket, self._capture_one,
                     self.capture_failures, self.strict)

    def _capture_one(self, b: int) -> None:
        # The dummy run writes no KV: first-pass slots -1, nothing covered for the expansion.
        h64, h32, l64, l32, q = self.h64, self.h32, self.l64, self.l32, self.q
        h64[:] = 0
        h32[:] = 0
        l64.seg(h64, "positions", b * q)[:] = np.arange(b * q) % q
        l64.seg(h64, "slots", b * q)[:] = -1
        l32.seg(h32, "seq_lens", b)[:] = q
        l32.seg(h32, "qsl", b + 1)[:] = np.arange(b + 1) * q
        l32.seg(h32, "eqsl", b + 1)[:] = np.arange(b + 1) * self.k
        l32.seg(h32, "live", b)[:] = 1
        self._upload()
        self.acc.zero_()
        run = lambda: self._body(b)  # noqa: E731
        self._graphs[b] = (emulate_graph(run, self.pool) if self.emulate
                           else capture_graph(run, self.pool))

    def _upload(self) -> None:
        self.d64.copy_(self.t64, non_blocking=True)
        self.d32.copy_(self.t32, non_blocking=True)

    # ---- per step ----------------------------------------------------------------------------
    @torch.inference_mode()  # writes the inference-tensor buffers (see __init__)
    def stage(self, b: int, req_ids: list[int], starts: list[int]) -> str | None:
        """Write the padded inputs of a graph of size ``b`` for requests whose trees are rows
        0..n-1 of the verify (root at position ``starts[i]``, target rows i*N ..), as if every
        node of depth <= D were accepted, and upload them. A reason when they do not fit."""
        n, q, w, page = len(req_ids), self.q, self.max_blocks, self.page
        tables = [self.allocator.tables[r] for r in req_ids]
        if max(map(len, tables)) > w:
            return "block_table_width"
        if max(starts) + q > self.bucket or max(starts) + 1 + q + self.f > self.bucket:
            return "max_seq_len"
        pos = [s + j for s in starts for j in range(q)]
        slots = [t[p // page] * page + p % page for s, t in zip(starts, tables)
                 for p in range(s, s + q)]
        h64, h32, l64, l32 = self.h64, self.h32, self.l64, self.l32
        put(l64.seg(h64, "positions"), pos, b * q, 0)
        put(l64.seg(h64, "slots"), slots, b * q, -1)
        put(l64.seg(h64, "row0"), range(0, n * self.n, self.n), b, 0)
        put(l64.seg(h64, "start"), starts, b, 0)
        put(l64.seg(h64, "covered"), [len(t) * page for t in tables], b, 0)
        put(l32.seg(h32, "seq_lens"), [s + q for s in starts], b, 0)
        put(l32.seg(h32, "qsl"), range(0, (n + 1) * q, q), b + 1, n * q)
        put(l32.seg(h32, "eqsl"), range(0, (n + 1) * self.k, self.k), b + 1, n * self.k)
        put(l32.seg(h32, "live"), [1] * n, b, 0)
        tab = l32.seg(h32, "tables", b * w).reshape(b, w)
        tab[:] = 0
        for i, t in enumerate(tables):
            tab[i, :len(t)] = t
        self._upload()
        return None

    @torch.inference_mode()
    def replay(self, b: int, n: int, target_hidden: torch.Tensor | list[torch.Tensor]
               ) -> tuple[torch.Tensor, ...]:
        """After ``acc`` [:n] is written: the fc output into the static hidden buffer, the
        replay, and the trees (tokens, parents, depth [n, N], mask [n, N, N]) as graph memory,
        valid until the pool's next replay (the next verify copies what it reads first)."""
        hidden = self.prop.base.combine(target_hidden)  # [T_target, h], usually precombined
        self.hidden[:hidden.shape[0]].copy_(hidden)
        graph, out = self._graphs[b]
        graph.replay()
        self.graph_replays += 1
        self.padded_rows += b - n
        return tuple(t[:n] for t in out) if b != n else tuple(out)
