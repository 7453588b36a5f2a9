"""The draft-tree proposal of a step whose acceptance is still on the device (early tree
propose, issue 15): one graph of the first pass and the expansion, replayed right after the
tree verify, before the host reads the acceptance.

The late path (``TreeProposer.propose``) stages the first pass over exactly the accepted path
and the expansion from the new root, both from host lists. Here the host stages only what does
not depend on acceptance, and the graph decides the rest from the verified trees and the
target's token per node (its argmax, or vanilla's draw for sampled requests;
``spec.tree_accept_device``):

* first pass: laid out exactly as the late path stages it into the late first-pass graph's
  buffers, from the device's n_acc: request i's n_acc + 1 rows back to back from
  query_start_loc[i] (a cumsum), at positions start + j, reading the accepted node of depth
  j + 1's token (then the bonus) and the target state of its node (the root, then the accepted
  nodes), seq_len start + n_acc + 1; the padded tokens after the live ones (``capture.pad``).
  The late graph's own body then runs on those buffers.
* expansion: root = start + n_acc + 1 (the new last token's position); step s's K nodes at
  position root + s, KV at tree slots root + s * K + i, seq_len root + F: the slots are looked
  up in the staged block tables on the device, and positions past the request's blocks write
  nothing (as ``TreeProposer._expand_rows``). Written into the late expand graph's buffers,
  whose body (``TreeProposer.expand``) then runs.
* target-KV moves: the accepted nodes' KV from their tree slots to their depths' positions, as
  the late path's host-made moves (``TreeModelRunner._apply_moves``), from host-staged slot
  tables and the device's path; after the draft, which never reads the target's KV.

Writing into the late graphs' buffers is safe: one step replays either those graphs or this
one, and every late replay stages (uploads) everything its views read. Sharing them also hands
the draft's compiled callables the very tensors they were compiled for: with buffers of its
own (inference tensors, other offsets) Dynamo compiled each of them again.

Blocks must cover the worst case (all D accepted) beforehand: the caller grows them. Padded
sequences: n_acc 0, q_len 0 in both passes (as ``capture.pad``), slot -1, seq_len 0.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from capture.buffer_writes import Region, region
from capture.cuda_graphs import capture_graph
from capture.emulate import emulate_graph
from capture.host_stage import put, put_rows, put_tables, staging
from compiled_spec.engine.early_propose_graph import EarlyGraphSurface
from compiled_spec.engine.propose_graph import _Layout

if TYPE_CHECKING:
    from compiled_spec.engine.tree_graphs import TreeProposeGraphs
    from compiled_spec.kv_cache import BlockAllocator
    from compiled_spec.spec.tree_proposer import TreeProposer


class EarlyTreeGraphs(EarlyGraphSurface):
    name = "tree_draft_early"

    def __init__(self, late: "TreeProposeGraphs", prop: "TreeProposer",
                 allocator: "BlockAllocator", batch_sizes: tuple[int, ...], max_blocks: int,
                 bucket: int, move_kv: Callable[[torch.Tensor], None], pool: Any = None,
                 emulate: bool = False, strict: bool = False,
                 verify_extras: dict[str, torch.Tensor] | None = None) -> None:
        """``move_kv(idx)``: moves the target's KV slots idx[0] -> idx[1] ([2, M] on the
        device) in every layer, as the late path's ``TreeModelRunner._apply_moves``.
        ``verify_extras``: the tree-verify graph's ``depth`` [bm * N] and ``tree_mask``
        [bm * N, N] buffers, where the replay leaves its trees' depths and masks."""
        cfg = prop.cfg
        self.prop, self.allocator, self.device = prop, allocator, prop.device
        self.fp, self.ex = late.first_pass, late.expand  # whose buffers and bodies it reuses
        self.move_kv = move_kv
        self.d, self.n, self.k = cfg.num_steps, cfg.num_draft_tokens, cfg.topk
        self.q, self.s, self.f = cfg.num_steps + 1, prop.expand_steps, cfg.num_forwarded
        self.sizes, self.bucket, self.max_blocks = sorted(batch_sizes), bucket, max_blocks
        self.page = allocator.page_size
        self.pool, self.emulate, self.strict = pool, emulate, strict
        bm, w = self.sizes[-1], max_blocks
        tm = bm * self.q
        self.l64 = _Layout([("slots", tm), ("row0", bm), ("start", bm), ("covered", bm),
                            ("tslots", bm * self.n), ("dslots", bm * self.d)])
        self.l32 = _Layout([("tables", bm * w), ("eqsl", bm + 1), ("live", bm)])
        self.t64, self.h64 = staging(self.l64.size, torch.int64, self.device)
        self.t32, self.h32 = staging(self.l32.size, torch.int32, self.device)
        with torch.inference_mode():  # the graphs compute under inference mode
            self.d64 = torch.zeros(self.l64.size, dtype=torch.int64, device=self.device)
            self.d32 = torch.zeros(self.l32.size, dtype=torch.int32, device=self.device)
            # [bm, 4, N] per request: its verified tree's tokens, parents, depths and the
            # target's token at each node (argmax or drawn); written after the verify, read
            # by the replay, and the step's one copy to the host (the host's acceptance reads
            # the same numbers).
            self.acc = torch.zeros(bm, 4, self.n, dtype=torch.int64, device=self.device)
            # The replay's trees, copied in the graph out of its pool (where the next verify's
            # replay may reuse their blocks): the tokens, parents and depths into acc[:, :3],
            # where the next step's replay reads them (its acceptance input); the depths and
            # masks also into the tree-verify graph's own input buffers, where the next verify
            # reads them. So neither the next verify's staging nor the next step's ``launch``
            # copies them (five eager launches a step on the host's path). Those buffers are
            # written by this replay and by a verify's staging alone, and the verify reading
            # them runs before the next replay.
            extras = verify_extras or {
                "depth": torch.zeros(bm * self.n, dtype=torch.int64, device=self.device),
                "tree_mask": torch.zeros(bm * self.n, self.n, dtype=torch.bool,
                                         device=self.device)}
            self.depth_out, self.mask_out = extras["depth"], extras["tree_mask"]
        self.acc_host, _ = staging(bm * 4 * self.n, torch.int64, self.device)
        self._graphs: dict[int, tuple[Any, Any]] = {}
        self._views: dict[int, tuple[Any, ...]] = {}  # per n: views of acc (_views_for)
        prop.early_stage.regions = self._regions()  # where its compiled writes go
        self.capture_failures: list[dict[str, Any]] = []
        self.graph_replays = self.padded_rows = 0
        self.fallback_reasons: dict[str, int] = {}

    # ---- the captured computation ------------------------------------------------------------
    def _body(self, b: int) -> tuple[torch.Tensor, ...]:
        q, w, K, S = self.q, self.max_blocks, self.k, self.s
        g64 = lambda name, n: self.l64.seg(self.d64, name, n)  # noqa: E731
        g32 = lambda name, n: self.l32.seg(self.d32, name, n)  # noqa: E731
        # The late graphs' own static views: the draft callables see the tensors they were
        # compiled for (dispatch keys, storage offsets, strides), so nothing compiles twice.
        fb = self.fp.buffers._views(b * q, b, q, self.bucket)
        eb = self.ex.buffers._views(b * K, b, K, self.bucket)
        tables = g32("tables", b * w).view(b, w)  # [b, W]
        # Acceptance, both layouts and the KV moves: one compiled function (compile=True),
        # which writes the layouts and the block tables into the late graphs' buffers itself
        # (12 copy kernels of 1-2 us each in every replay before: H100, thirty-eighth session).
        fbuf, ebuf = self.fp.buffers, self.ex.buffers
        moves = self.prop.early_stage_fn(
            self.acc[:b], g32("live", b), g64("start", b), g64("slots", b * q), g64("row0", b),
            tables, g64("covered", b), g64("tslots", b * self.n).view(b, self.n),
            g64("dslots", b * self.d).view(b, self.d), self.d, q, K, S, self.page, self.f,
            flats=(fbuf.flat64, fbuf.flat32, ebuf.flat64, ebuf.flat32),
            extra=(tables, tables, g32("eqsl", b + 1)))
        feed, for_logits = self.fp.fn(fb)  # [b, h] each: every request's last row
        eb.extras["feed"].copy_(feed)
        eb.extras["for_logits"].copy_(for_logits)
        trees = self.ex.fn(eb)  # tokens, parents, depth [b, N], mask [b, N, N]
        # The accepted nodes' target KV to the positions of their depths (the late path's
        # host-made moves); the draft above never reads the target's KV.
        self.move_kv(moves)  # [2, b*D]
        # acc was read above (stage), and the step's host copy of it was issued before the
        # replay: from here on its first three planes hold the next step's trees.
        self.acc[:b, :3].copy_(torch.stack(trees[:3], dim=1))  # [b, 3, N]
        self.depth_out[:b * self.n].copy_(trees[2].reshape(-1))  # [b * N]
        self.mask_out[:b * self.n].copy_(trees[3].reshape(-1, self.n))  # [b * N, N]
        return trees

    def _regions(self) -> tuple[Region, ...]:
        """Where the stage's outputs go in the late buffers (``EarlyTreeStage``'s order: the
        first pass's ids, positions, slots, rows, lengths, starts, the expansion's positions,
        slots, lengths, then the block tables of both and the expansion's starts); the same
        places at every batch size (``capture.buffer_writes.region``)."""
        b = self.sizes[-1]
        fbuf, ebuf = self.fp.buffers, self.ex.buffers
        fb = fbuf._views(b * self.q, b, self.q, self.bucket)
        eb = ebuf._views(b * self.k, b, self.k, self.bucket)
        f = lambda v: region(fbuf, v, 0)  # noqa: E731
        e = lambda v: region(ebuf, v, 2, steps=v.dim() == 2)  # noqa: E731  ([S, b*K] when S > 1)
        return (f(fb.input_ids), f(fb.positions), f(fb.meta.slot_mapping), f(fb.rows),
                f(fb.meta.seq_lens), f(fb.meta.query_start_loc), e(eb.positions),
                e(eb.meta.slot_mapping), e(eb.meta.seq_lens), f(fb.meta.block_tables),
                region(ebuf, eb.meta.block_tables, 2), region(ebuf, eb.meta.query_start_loc, 2))

    # ---- start-up ----------------------------------------------------------------------------
    def _capture_one(self, b: int) -> None:
        # The dummy run writes no KV: first-pass slots -1, nothing covered for the expansion.
        h64, h32, l64, l32, q = self.h64, self.h32, self.l64, self.l32, self.q
        h64[:] = 0
        h32[:] = 0
        l64.seg(h64, "slots", b * q)[:] = -1
        l32.seg(h32, "eqsl", b + 1)[:] = np.arange(b + 1) * self.k
        l32.seg(h32, "live", b)[:] = 1
        self._upload()
        self.acc.zero_()
        run = lambda: self._body(b)  # noqa: E731
        self._graphs[b] = (emulate_graph(run, self.pool) if self.emulate
                           else capture_graph(run, self.pool))

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
        slot = lambda t, p: t[p // page] * page + p % page  # noqa: E731
        slots = [slot(t, p) for s, t in zip(starts, tables) for p in range(s, s + q)]
        # Target-KV moves: each tree slot (a source), each depth's slot (a destination); the
        # padded rows' self-moves on request 0's slot past its deepest possible destination.
        noop = slot(tables[0], starts[0] + self.d + 1)
        tslots = [slot(t, s + k) for s, t in zip(starts, tables) for k in range(self.n)]
        dslots = [slot(t, s + j + 1) for s, t in zip(starts, tables) for j in range(self.d)]
        h64, h32, l64, l32 = self.h64, self.h32, self.l64, self.l32
        put(l64.seg(h64, "slots"), slots, b * q, -1)
        put(l64.seg(h64, "row0"), range(0, n * self.n, self.n), b, 0)
        put(l64.seg(h64, "start"), starts, b, 0)
        put(l64.seg(h64, "covered"), [len(t) * page for t in tables], b, 0)
        put(l64.seg(h64, "tslots"), tslots, b * self.n, noop)
        put(l64.seg(h64, "dslots"), dslots, b * self.d, noop)
        put(l32.seg(h32, "eqsl"), range(0, (n + 1) * self.k, self.k), b + 1, n * self.k)
        put(l32.seg(h32, "live"), [1] * n, b, 0)
        put_tables(l32.seg(h32, "tables", b * w).reshape(b, w), tables)
        self._upload()
        return None

    @torch.inference_mode()
    def replay(self, b: int, n: int, target_hidden: torch.Tensor | list[torch.Tensor]
               ) -> tuple[torch.Tensor, ...]:
        """After ``acc`` [:n] is written: the fc output into the first pass's row source, the
        replay, and the trees (tokens, parents, depth [n, N], mask [n, N, N]) in the graph's
        own memory (``trees``), valid until its next replay."""
        hidden = self.prop.base.combine(target_hidden)  # [T_target, h], usually precombined
        put_rows(self.fp.buffers.extras["hidden"], hidden)  # in place when precombined
        graph, _ = self._graphs[b]
        graph.replay()
        self.graph_replays += 1
        self.padded_rows += b - n
        return self.trees(n)

    def trees(self, n: int) -> tuple[torch.Tensor, ...]:
        """The last replay's trees of requests 0..n-1: tokens, parents [n, N] (rows of
        ``acc``, strided), depth [n, N] and mask [n, N, N] (the verify's buffers); the same
        view objects every step (made once per n: each view is an op on the host's path), so
        ``holds`` is an identity test."""
        return self._views_for(n)[1]

    def _views_for(self, n: int) -> tuple[Any, ...]:
        views = self._views.get(n)
        if views is None:
            info = self.acc[:n, :3].transpose(0, 1)  # [3, n, N]
            views = self._views[n] = (
                info, (info[0], info[1], self.depth_out[:n * self.n].view(n, self.n),
                       self.mask_out[:n * self.n].view(n, self.n, self.n)),
                self.acc[:n, 3],  # [n, N] drawn
                self.acc[:n], self.acc_host[:n * 4 * self.n])  # [n, 4, N], its host copy
        return views

    def tree_info(self, n: int) -> torch.Tensor:  # [3, n, N] a view of acc
        return self._views_for(n)[0]

    def drawn(self, n: int) -> torch.Tensor:  # [n, N] the drawn-token plane of acc
        return self._views_for(n)[2]

    def acc_rows(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """acc [n, 4, N] and the pinned host buffer its copy lands in."""
        views = self._views_for(n)
        return views[3], views[4]

    def holds_tree(self, tokens: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether a tree's tokens and mask are the last replay's, in place."""
        views = self._views.get(tokens.shape[0])
        return views is not None and tokens is views[1][0] and mask is views[1][3]

    def holds(self, tree_info: torch.Tensor) -> bool:
        """Whether ``tree_info`` [3, n, N] is ``tree_info(n)`` (the trees in place)."""
        views = self._views.get(tree_info.shape[1])
        return views is not None and tree_info is views[0]
