"""Engine steps with draft trees: the target verifies each request's tree in one forward with
tree attention, acceptance walks the tree on the host (from the step's one device-to-host copy
of the trees and the tokens drawn at their nodes), and the accepted path's KV is moved into
place before the next step.

Acceptance, greedy or sampled, is the coupling rule of ``spec.rejection`` applied along the tree:
at every node the token vanilla decoding would draw at the next position is drawn (argmax, or an
inverse-CDF draw keyed by (seed, position)); the child holding that token is accepted, and at the
first node without one that token is emitted. Exact for deterministic (top-k) candidates, and a
seeded request writes exactly its vanilla output.

A step verifies trees only when every request in it is decoding (one new token): a step that
also prefills runs the chain path with no drafts, and the requests re-propose after it. Requests
that cannot take a tree this step (too near their end for the tree's slots, or not speculating)
decode plainly inside the tree step as one-node trees. Greedy all-tree steps with graphs launch
the next trees before the host reads the acceptance (``engine.early_tree``), then the next
trees' verify before the engine's bookkeeping (``engine.verify_ahead_tree``). The verify's
staging is ``engine.tree_verify``; with compile=True its forward runs through ``target_fn``
(compiled; on CUDA a tree-verify graph per batch size, see ``engine.tree_graphs``) and the
proposer's draft forwards through the compiled draft.
"""
from __future__ import annotations

import numpy as np
import torch

from compiled_spec.engine.batch import Span, build_sampling_tensors, to_device
from compiled_spec.engine.early_tree import EarlyTree, EarlyTreeStep
from compiled_spec.engine.logprobs import device_logprobs, gather_logprobs, unpack_logprobs
from compiled_spec.engine.model_runner import ModelRunner, StepOutput, _Pending
from compiled_spec.engine.request import Request
from compiled_spec.engine.tree_verify import stage_and_verify
from compiled_spec.engine.verify_ahead_tree import TreeVerifyAhead
from compiled_spec.profile import phase
from compiled_spec.sampler import STREAM_TOKEN, apply_filters, position_keys, sample_from_probs
from compiled_spec.spec.proposer import ProposeBatch
from compiled_spec.spec.tree import KVCompactor, TreeConfig, accept_paths
from compiled_spec.spec.tree_proposer import DraftTree, TreeProposer


class TreeModelRunner(ModelRunner):
    def __init__(self, *args, tree: TreeConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tree = tree
        self.proposer = TreeProposer(self.proposer, tree)
        self.k = self.verify_k = self._drafts_k = tree.num_steps  # trees never shrink k
        self.lookahead = tree.lookahead
        # Greedy tree steps propose before the host reads their acceptance (early_tree.py).
        self.early = EarlyTree(self)  # type: ignore[assignment]
        # ... and launch the next trees' verify once it is read (verify_ahead_tree.py).
        self.ahead = TreeVerifyAhead(self)
        self._early_tree: EarlyTreeStep | None = None  # this step's, until ``propose``
        self._tree: DraftTree | None = None
        self._tree_row: dict[int, int] = {}
        self._compact = KVCompactor()  # one launch for every layer on a GPU
        # The last verify's KV moves (req_id -> (src slots, dst slots)), made after the next
        # proposal is launched: they only have to land before the next target forward, and
        # between the step's host copy and that launch the GPU has nothing queued.
        self._moves: dict[int, tuple[list[int], list[int]]] = {}
        self._draft_idx: dict[tuple[int, ...], dict[str, list[int]]] = {}  # _draft_rows

    def reset(self) -> None:
        super().reset()
        self._tree, self._tree_row, self._early_tree = None, {}, None
        self._moves = {}  # the step's requests are recomputed: nothing of it is kept

    def _apply_moves(self) -> None:
        """Move the accepted nodes' target KV into place, for the requests that still hold
        their blocks. One that finished (or was preempted) since is left out: its blocks are
        free, and the proposal may have grown another request into them."""
        moves, self._moves = self._moves, {}
        live = [mv for rid, mv in moves.items() if rid in self.allocator.tables]
        src = [s for ss, _ in live for s in ss]
        dst = [d for _, ds in live for d in ds]
        self._compact(self._caches(), src, dst)

    def _caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.self_attn.k_cache, layer.self_attn.v_cache)
                for layer in self.model.model.layers]

    def move_kv(self, idx: torch.Tensor) -> None:  # [2, M] slots on the device
        """The early tree graph's KV moves (made in the graph, in place of ``_moves``)."""
        self._compact.move(self._caches(), idx)

    def _draft_rows(self, tree_rows: list[int]) -> dict[str, list[int]]:
        """An all-tree batch's drafted input rows and their rows in the trees' tokens: the same
        every step for a batch whose tree rows are unchanged, so built once per row order."""
        key = tuple(tree_rows)
        rows = self._draft_idx.get(key)
        if rows is None:
            n = self.tree.num_draft_tokens
            if len(self._draft_idx) > 64:  # batches come and go: keep the cache small
                self._draft_idx.clear()
            rows = self._draft_idx[key] = {
                "draft_dst": [i * n + j for i in range(len(key)) for j in range(1, n)],
                "draft_src": [r * n + j for r in key for j in range(1, n)]}
        return rows

    def _takes_tree(self, req: Request) -> bool:
        return self.takes_tree_at(req, req.num_tokens)

    def takes_tree_at(self, req: Request, num_tokens: int) -> bool:
        """Whether ``req`` with ``num_tokens`` tokens may verify a tree: room for at least one
        draft, and the tree's slots inside max_model_len. Slots may pass the request's own
        budget (they are scratch); acceptance is capped to the budget."""
        return (req.spec_enabled and req.max_total_tokens - num_tokens >= 2
                and num_tokens - 1 + self.lookahead <= self.max_model_len)

    def covered(self, req: Request) -> int:
        """Positions the blocks ``req`` holds cover."""
        return len(self.allocator.tables.get(req.req_id, ())) * self.allocator.page_size

    def _grow_cap(self, req: Request) -> int:
        return self.max_model_len

    def num_drafts_for(self, req: Request) -> int:
        if req.req_id not in self._tree_row or req.num_computed != req.num_tokens - 1:
            return 0
        if not self._takes_tree(req) or self.covered(req) < req.num_tokens - 1 + self.lookahead:
            return 0  # e.g. the pool could not grow this request's tree slots
        return self.tree.num_draft_tokens - 1

    @torch.inference_mode()
    def execute(self, reqs: list[Request], num_new: list[int]) -> StepOutput:
        if self._moves:  # no proposal ran since the last verify: move before any forward
            self._apply_moves()
        if any(n != 1 for n in num_new) or not any(self.num_drafts_for(r) for r in reqs):
            self._tree_row = {}
            return super().execute(reqs, num_new)  # no drafts in this step: the chain path
        return self._execute_tree(reqs)

    def _execute_tree(self, reqs: list[Request]) -> StepOutput:
        n_nodes, dev, alloc = self.tree.num_draft_tokens, self.device, self.allocator
        # The verify the last step launched for this batch (engine/verify_ahead_tree.py).
        v = self.ahead.take_tree(reqs) or stage_and_verify(self, reqs)
        clock = self.clock  # the tree step's host phases (engine/host_clock.py)
        clock.mark("verify")
        in_tree, starts, qsl, dst = v.in_tree, v.starts, v.qsl, v.dst
        logits, target_hidden, tree_info = v.logits, v.target_hidden, v.tree_info
        all_tree = all(in_tree)
        # Staged while the verify runs; None: this step proposes late (the reason counted).
        early = self._early_tree = self.early.plan_tree(reqs, in_tree, starts)
        clock.mark("plan")
        with phase("rejection_sample"):
            greedy = all(r.params.greedy for r in reqs)  # host-known: no sampling tensors
            if early is not None and greedy:  # straight into the early graph's input
                drawn = None
            elif greedy:
                drawn = logits.argmax(dim=-1)  # [T]
            else:  # the token vanilla sampling would draw after each node (position + 1)
                reps = [qsl[i + 1] - qsl[i] for i in range(len(reqs))]
                positions = v.positions  # [T]; from the host lists when those fed a graph
                if positions is None:
                    positions = to_device(v.base, dev) + tree_info[2].reshape(-1)
                sg = self.sample_graph  # one replay (engine/sample_graph.py), else eager
                drawn = None if sg is None else sg.draw_rows(reqs, reps, logits, positions + 1)
                if drawn is None:
                    st = build_sampling_tensors(reqs, dev, reps)
                    drawn = sample_from_probs(apply_filters(logits, st), position_keys(
                        st.seeds, positions + 1, STREAM_TOKEN))
            at_nodes = (self.early.draw(logits, len(reqs)) if drawn is None  # [B_t, N]
                        else (drawn if dst is None else drawn[dst]).view(-1, n_nodes))
            t_idx = [i for i, t in enumerate(in_tree) if t]
            n_t, d = len(t_idx), self.tree.num_steps
            ks = [r.params.logprobs for r in reqs]
            lp_copy = None
            if early is not None:  # the next trees drafted before the host reads the copy
                if ks.count(None) < len(ks):  # every node's, before the replay (a node's
                    # emitted token is the one drawn there); the copy's wait comes with acc's
                    lp_copy = self.copy_to_host(device_logprobs(
                        logits, at_nodes.reshape(-1), max(k for k in ks if k is not None)))
                copy = self.early.launch(early, tree_info, at_nodes, target_hidden)
                host = self.to_host(copy, numpy=True)  # [n, 4, N]: as below, per request
                h_tok, h_par, h_depth, h_drawn = host.reshape(n_t, 4, n_nodes).transpose(1, 0, 2)
            else:
                # The step's one device-to-host copy: every tree's tokens, parents, depths and
                # the token drawn at each node, then one token per plain request.
                parts = [tree_info.reshape(-1), at_nodes.reshape(-1)]
                if not all_tree:
                    parts.append(drawn[to_device([qsl[i] for i, t in enumerate(in_tree)
                                                  if not t], dev)])
                host = self.to_host(torch.cat(parts), numpy=True)
                h_tok, h_par, h_depth, h_drawn = host[:4 * n_t * n_nodes].reshape(
                    4, n_t, n_nodes)
            # Accept no more drafts than the request's budget leaves room for (plus the bonus).
            cap = np.array([reqs[i].max_total_tokens - reqs[i].num_tokens - 1 for i in t_idx])
            path, n_acc, bonus = accept_paths(h_tok, h_par, h_drawn, h_depth, d, cap)
            clock.mark("accept")  # the host's walk of the copied trees
            # Each accepted node's KV moves from its tree slot (position root + node) to the
            # position of its depth; a node already there stays. Made in ``propose`` (an early
            # step's graph made them already).
            for row, i in enumerate(t_idx if early is None else ()):
                rid, root = reqs[i].req_id, starts[i]
                src, dst_slots = [], []
                for j in range(int(n_acc[row])):
                    node = int(path[row, j])
                    if node != j + 1:
                        src.append(alloc.slot(rid, root + node))
                        dst_slots.append(alloc.slot(rid, root + j + 1))
                if src:
                    self._moves[rid] = (src, dst_slots)
        plain = iter(host[4 * n_t * n_nodes:].tolist() if early is None else ())
        new_tokens, num_draft, spans, rows_by_req = [], [], [], {}
        row = 0
        for i, (r, t) in enumerate(zip(reqs, in_tree)):
            spans.append(Span(r.req_id, starts[i], 1))
            if not t:
                new_tokens.append([next(plain)])
                num_draft.append(0)
                continue
            nodes = path[row, :n_acc[row]].tolist()
            new_tokens.append(h_tok[row, nodes].tolist() + [int(bonus[row])])
            num_draft.append(d)
            rows_by_req[r.req_id] = [qsl[i]] + [qsl[i] + j for j in nodes]
            row += 1
        if early is not None:  # the next trees' verify, before the engine's bookkeeping
            clock.mark("accept")  # ... and the token lists it makes
            early.tree = self.ahead.launch_tree(reqs, starts, new_tokens, early.tree)
            clock.mark("launch_ahead")
        # The first pass covers the root and the accepted nodes (positions are now sequential).
        self._pending = None if early is not None else _Pending(
            hidden=target_hidden, spans=spans, row_start=qsl[:-1], num_draft=[0] * len(reqs),
            rows_by_req=rows_by_req)
        lp = None
        if lp_copy is not None:  # (an early step: every request a tree, rows as the logits')
            lp = unpack_logprobs(lp_copy.wait().numpy(),
                                 [rows_by_req[r.req_id] for r in reqs], new_tokens, ks)
        elif ks.count(None) < len(ks):  # the rows the tokens came from
            rows = [logits[to_device(rows_by_req.get(r.req_id, [qsl[i]]), dev)]
                    for i, r in enumerate(reqs)]
            lp = gather_logprobs(rows, new_tokens, ks)
        return StepOutput(new_tokens=new_tokens, num_draft=num_draft, logprobs=lp)

    def propose(self, reqs: list[Request], accepted: dict[int, int], draft: bool = True) -> None:
        self._tree_row = {}
        early, self._early_tree = self._early_tree, None
        if early is not None:  # drafted already, before the acceptance was read
            self._pending = None
            self.early.finish(early, reqs, accepted, draft)
        else:
            super().propose([r for r in reqs if self._takes_tree(r)], accepted, draft)
        # After the draft's launches: the target's KV is not read until the next verify (the
        # draft has KV of its own), so the move is off the GPU's idle path.
        if self._moves:
            self._apply_moves()

    def _propose(self, chosen: list[Request], batch: ProposeBatch, pend: _Pending) -> None:
        self._tree, _ = self.proposer.propose(batch, pend.hidden)
        self._tree_row = {r.req_id: i for i, r in enumerate(chosen)}
