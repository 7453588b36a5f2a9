"""EAGLE-2 dynamic draft trees: the first pass as in chain drafting, then ``num_steps - 1``
expansions of the ``topk`` best nodes, then the ``num_draft_tokens - 1`` best nodes by cumulative
draft log-probability form the tree the target verifies.

Draft positions: the first pass ends at position L-2 (its last row reads the root token, the
last committed one, at L-1... paired with the target state at L-2), so a depth-d node is the
draft's input at position L-2+d. Expanded node f (in expansion order) writes its draft KV at
position L-1+f, and attends to the draft prefix (< L-1) plus its expanded ancestors and itself
(``paged_tree_attention``). The next first pass rewrites the draft KV of every accepted position,
so no draft KV needs compacting.

A propose is two calls, each over a ``LiveBatch`` so that ``engine.tree_graphs`` can replay it
as a padded CUDA graph: the first pass (variable length, causal) and ``expand`` (everything
after it: fixed shapes per batch size, every step's metadata built on the host beforehand).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from capture.pad import LiveBatch
from capture.host_stage import HostBatch
from compiled_spec.engine.batch import (build_host_batch, host_batch_to_device,
                                          metadata_to_device, to_device)
from compiled_spec.spec.proposer import EagleProposer, ProposeBatch
from compiled_spec.spec.tree import TreeConfig
from compiled_spec.spec.tree_glue import EarlyTreeStage, TreeGlue

if TYPE_CHECKING:
    from compiled_spec.engine.tree_graphs import TreeProposeGraphs


@dataclass
class DraftTree:
    """One verification tree per request (row b = ``first_pass[b]``'s request)."""

    tokens: torch.Tensor  # [B, N] target-vocab ids; column 0 (root) is filled by the runner
    parents: torch.Tensor  # [B, N] tree index of the parent, root -1
    depth: torch.Tensor  # [B, N] int64, root 0
    mask: torch.Tensor  # [B, N, N] bool ancestor-or-self


class TreeProposer:
    def __init__(self, base: EagleProposer, cfg: TreeConfig) -> None:
        self.base, self.cfg = base, cfg
        self.draft, self.allocator, self.device = base.draft, base.allocator, base.device
        self.k = cfg.num_steps  # deepest path a tree can accept (engine stats: positions)
        self.layer_names = base.layer_names
        # compile=True with CUDA graphs (or emulated ones): both calls replay padded graphs;
        # what a graph cannot take runs compiled and is counted there (engine.tree_graphs).
        self.graph: "TreeProposeGraphs | None" = None
        # ``expand``'s parts (spec/tree_glue.py); compile.use_compiled swaps in their compiled
        # versions.
        self.glue = TreeGlue(base.draft, cfg.topk, cfg.num_steps, cfg.num_draft_tokens)
        self.head_fn, self.expand_step_fn, self.finish_fn = (self.glue.head,
                                                             self.glue.expand_step,
                                                             self.glue.finish)
        # An early tree step's device-side staging (engine/early_tree_graph.py), also swapped.
        self.early_stage = EarlyTreeStage()
        self.early_stage_fn = self.early_stage
        # Expansion s's nodes see their own tree slots (s-2)K .. (s-1)K - 1: constants made here,
        # on the device, and not inside a graph capture (where nothing runs until a replay).
        K, F = cfg.topk, max(cfg.num_forwarded, 1)
        slot = torch.arange(F, device=base.device)
        self._own_slot = [(slot[None, :] == (s * K + torch.arange(K, device=base.device))[:, None])
                          [None] for s in range(max(cfg.num_steps - 1, 0))]  # each [1, K, F]

    def prompt_head_rows(self) -> int | None:
        """As ``EagleProposer.prompt_head_rows``: the tree's first-pass graph's positions."""
        g = self.graph
        return g.first_pass.query_len if g is not None and g.first_pass.enabled else None

    def write_head(self, pre: ProposeBatch,
                   target_hidden: torch.Tensor | list[torch.Tensor]) -> None:
        self.base.write_head(pre, target_hidden)

    def precombine(self, target_hidden: list[torch.Tensor]) -> None:
        """EAGLE-3's fc issued right after the verify (``EagleProposer.precombine``), for the
        graph path below."""
        g = self.graph
        rows = (target_hidden if isinstance(target_hidden, list) else [target_hidden])[0].shape[0]
        self.base.precombine(target_hidden, active=g is not None,
                             out=None if g is None else g.fc_out(rows))

    # The compiled callables live on the chain proposer (compile.use_compiled swaps them).
    @property
    def first_pass_fn(self) -> Any:
        return self.base.first_pass_fn

    @first_pass_fn.setter
    def first_pass_fn(self, fn: Any) -> None:
        self.base.first_pass_fn = fn

    @property
    def step_fn(self) -> Any:
        return self.base.step_fn

    @step_fn.setter
    def step_fn(self, fn: Any) -> None:
        self.base.step_fn = fn

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch, target_hidden: torch.Tensor | list[torch.Tensor]
                ) -> tuple[DraftTree, None]:
        dev = self.device
        g = self.graph
        if g is None:
            feed, for_logits, _, meta = self.base.first_pass(batch, target_hidden)
            last = (meta.query_start_loc[1:] - 1).long()  # [B] each request's last row
            return DraftTree(*self.expand(self.expand_batch(batch, feed[last],
                                                            for_logits[last]))), None
        # Graphs: EAGLE-3's fc eagerly, then both calls staged from host lists (a batch no
        # graph fits runs the graph's body, counted; a prompt's first pass is cut first). The
        # fc runs over all of the step's target rows (N per request at batch 1: cheap); the
        # first-pass graph gathers the accepted ones by the staged hidden_rows, so no index
        # list is uploaded and no gather launched between the acceptance and the replay.
        if g.first_pass.enabled:  # a prompt's first pass: its head eager, the rest replayed
            batch, target_hidden = self.base.cut_first_pass(batch, target_hidden,
                                                            g.first_pass.query_len)
        hidden = self.base.combine(target_hidden)  # [T_target, h]
        hb = build_host_batch(self.allocator, batch.first_pass, batch.token_ids)
        hb.rows = batch.hidden_rows
        last = g.first_pass.run_host(hb, None, {"hidden": hidden})  # ([B, h], [B, h])
        if last is None:
            ids, positions, meta = host_batch_to_device(hb, dev)
            last = g.first_pass.fn(LiveBatch(ids, positions, meta, extras={"hidden": hidden},
                                             rows=to_device(batch.hidden_rows, dev)))
        extras = {"feed": last[0], "for_logits": last[1]}
        out = g.expand.run_host(self._expand_rows(batch), None, extras)
        if out is None:
            out = g.expand.fn(self.expand_batch(batch, *last))
        return DraftTree(*out), None

    def expand(self, live: LiveBatch) -> tuple[torch.Tensor, ...]:
        """Everything after the first pass, with no host reads: layer 1 from the first pass's
        last rows (extras ``feed`` / ``for_logits`` [B, h]), ``num_steps - 1`` expansions
        (step j's metadata: ``live.step(j)``), then node selection. -> DraftTree's tensors.

        Three callables do the work (``head_fn``, ``expand_step_fn``, ``finish_fn``), each one
        graph under compile=True: the top-k / score / gather glue fuses into a few kernels
        beside the draft layer instead of ~50 eager ATen kernels per expansion, and every
        kernel of a CUDA graph costs the GPU ~1 us at the least (H200,
        results/2026-12-01_h200_session7/graph_launch.log)."""
        cfg, dev = self.cfg, self.device
        K, F = cfg.topk, cfg.num_forwarded
        feed0 = live.extras["feed"]  # [B, h]
        b, h = feed0.shape
        score, tok = self.head_fn(live.extras["for_logits"])  # [B, K] layer 1
        # Every candidate (all layers) for the final selection; each expansion reads only the
        # layer before it: its frontier is always the K best of that layer, so nothing is
        # concatenated or gathered across layers inside the loop.
        cand_tok, cand_score, sels = [tok], [score], []
        x_tok, x_score = tok, score  # [B, K] the frontier's tokens and cumulative scores
        # Contiguous, as later steps' gathered states are: one compiled graph for every step.
        x_hid = feed0[:, None].expand(b, K, h).contiguous()  # [B, K, h] their input states
        x_fm = torch.zeros(b, K, max(F, 1), dtype=torch.bool, device=dev)  # their tree masks
        tree_start = None
        for step in range(2, cfg.num_steps + 1):
            pos, meta = live.step(step - 2)  # [B*K]
            if tree_start is None:  # the same every step: seq_lens = root + F
                tree_start = meta.seq_lens - F  # tree slots start right after the prefix
            c_tok, c_score, sel, x_tok, x_score, x_hid, x_fm = self.expand_step_fn(
                x_tok, x_hid, x_score, x_fm, self._own_slot[step - 2], pos,
                replace(meta, tree_start=tree_start))
            cand_tok.append(c_tok)
            cand_score.append(c_score)
            sels.append(sel)
        return self.finish_fn(cand_tok, cand_score, sels)

    @property
    def expand_steps(self) -> int:
        """Metadata steps ``expand`` takes: one per expansion (one inert step when there are
        none, so the graphs' static buffers keep one layout)."""
        return max(self.cfg.num_steps - 1, 1)

    def _expand_rows(self, batch: ProposeBatch) -> HostBatch:
        """``expand``'s inputs as host lists: every expansion's positions, slots and sequence
        lengths ([S][B*K], flat when S = 1). Expansion s has K nodes of depth s per request,
        input at position L-2+s, KV at tree slots (s-1)K .. sK-1 (positions L-1+f)."""
        K, F, S = self.cfg.topk, self.cfg.num_forwarded, self.expand_steps
        alloc = self.allocator
        positions = [[] for _ in range(S)]
        slots = [[] for _ in range(S)]
        tables, starts = [], []
        for s in batch.first_pass:
            root = s.start + s.length  # L-1: the root's position; tree slots start here
            starts.append(root)
            tables.append(alloc.tables[s.req_id])
            covered = len(alloc.tables[s.req_id]) * alloc.page_size
            for j in range(S):
                positions[j].extend([root + j] * K)
                # Slots past the request's blocks (the pool could not grow it) write nothing;
                # such a tree is never verified (TreeModelRunner.num_drafts_for).
                slots[j].extend(alloc.slot(s.req_id, root + j * K + i)
                                if root + j * K + i < covered else -1 for i in range(K))
        b = len(starts)
        lens = [[r + F for r in starts] for _ in range(S)]
        one = S == 1
        return HostBatch(input_ids=[0] * (b * K),  # unused: sizes the batch
                         positions=positions[0] if one else positions,
                         slots=slots[0] if one else slots, seq_lens=lens[0] if one else lens,
                         query_start_loc=[i * K for i in range(b + 1)], tables=tables,
                         max_query_len=K, max_seq_len=max(starts) + F)

    def expand_batch(self, batch: ProposeBatch, feed: torch.Tensor,  # [B, h]
                     for_logits: torch.Tensor,  # [B, h]
                     ) -> LiveBatch:
        """``expand``'s input as device tensors (``_expand_rows``), [S, B*K] when S > 1."""
        hb = self._expand_rows(batch)
        pos, meta = metadata_to_device(self.device, hb.positions, hb.slots, hb.seq_lens,
                                       hb.query_start_loc, hb.tables, hb.max_query_len,
                                       hb.max_seq_len)
        ids = torch.zeros(hb.num_tokens, dtype=torch.int64, device=self.device)
        return LiveBatch(ids, pos, meta, extras={"feed": feed, "for_logits": for_logits})
