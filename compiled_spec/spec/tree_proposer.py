"""EAGLE-2 dynamic draft trees: the first pass as in chain drafting, then ``num_steps - 1``
expansions of the ``topk`` best nodes, then the ``num_draft_tokens - 1`` best nodes by cumulative
draft log-probability form the tree the target verifies.

Draft positions: the first pass ends at position L-2 (its last row reads the root token, the
last committed one, at L-1... paired with the target state at L-2), so a depth-d node is the
draft's input at position L-2+d. Expanded node f (in expansion order) writes its draft KV at
position L-1+f, and attends to the draft prefix (< L-1) plus its expanded ancestors and itself
(``paged_tree_attention``). The next first pass rewrites the draft KV of every accepted position,
so no draft KV needs compacting.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.engine.batch import build_metadata, metadata_to_device, to_device
from compiled_spec.spec.proposer import EagleProposer, ProposeBatch
from compiled_spec.spec.tree import TreeConfig, ancestor_mask, select_nodes


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
        self.graph = None  # trees run without CUDA graphs for now (see the issue notes)

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch, target_hidden: torch.Tensor | list[torch.Tensor]
                ) -> tuple[DraftTree, None]:
        cfg, draft, dev = self.cfg, self.draft, self.device
        K = cfg.topk
        rows = to_device(batch.hidden_rows, dev)
        aux = [h[rows] for h in target_hidden] if isinstance(target_hidden, list) \
            else [target_hidden[rows]]
        ids = to_device(batch.token_ids, dev)
        positions, meta = build_metadata(self.allocator, batch.first_pass, dev)
        feed, for_logits = self.base.first_pass_fn(aux, ids, positions,
                                                   self.base._metas(meta))
        last = (meta.query_start_loc[1:] - 1).long()  # [B]
        b = last.shape[0]
        lp = torch.log_softmax(draft.compute_logits(for_logits[last]).float(), dim=-1)
        score, tok = lp.topk(K, dim=-1)  # [B, K] layer 1
        cand_tok, cand_score = [draft.draft_to_target(tok)], [score]
        cand_depth = [torch.ones(b, K, dtype=torch.int64, device=dev)]
        cand_parent = [torch.full((b, K), -1, dtype=torch.int64, device=dev)]
        cand_hidden = [feed[last][:, None].expand(b, K, -1)]  # input hidden of each candidate
        F = cfg.num_forwarded
        cand_fmask = [torch.zeros(b, K, max(F, 1), dtype=torch.bool, device=dev)]
        frontier = torch.arange(K, device=dev).expand(b, K)  # candidate ids of the layer
        n_cand = K
        for step in range(2, cfg.num_steps + 1):
            tok_all, hid_all = torch.cat(cand_tok, 1), torch.cat(cand_hidden, 1)
            fmask_all, score_all = torch.cat(cand_fmask, 1), torch.cat(cand_score, 1)
            f0 = (step - 2) * K  # expansion index of this layer's first node
            x_tok = torch.gather(tok_all, 1, frontier)  # [B, K]
            x_hid = torch.gather(hid_all, 1, frontier[:, :, None].expand(-1, -1, hid_all.shape[-1]))
            fm = torch.gather(fmask_all, 1, frontier[:, :, None].expand(-1, -1, F))
            fm[:, torch.arange(K, device=dev), f0 + torch.arange(K, device=dev)] = True  # self
            pos, tmeta = self._expand_meta(batch, f0, step - 1, fm)
            new_feed, fl = draft(x_tok.reshape(-1), x_hid.reshape(b * K, -1), pos,
                                 {n: tmeta for n in self.base.layer_names})
            lp = torch.log_softmax(draft.compute_logits(fl).float(), dim=-1)  # [B*K, Vd]
            c_score, c_tok = lp.topk(K, dim=-1)
            par_score = torch.gather(score_all, 1, frontier)  # [B, K]
            c_score = (par_score[:, :, None] + c_score.view(b, K, K)).reshape(b, K * K)
            cand_tok.append(draft.draft_to_target(c_tok).view(b, K * K))
            cand_score.append(c_score)
            cand_depth.append(torch.full((b, K * K), step, dtype=torch.int64, device=dev))
            cand_parent.append(frontier[:, :, None].expand(b, K, K).reshape(b, K * K))
            cand_hidden.append(new_feed.view(b, K, 1, -1).expand(b, K, K, -1).reshape(b, K * K, -1))
            cand_fmask.append(fm[:, :, None].expand(b, K, K, F).reshape(b, K * K, F))
            frontier = n_cand + c_score.topk(K, dim=-1).indices  # next layer's expanded nodes
            n_cand += K * K
        n = cfg.num_draft_tokens - 1
        top, par, dep = select_nodes(torch.cat(cand_score, 1), torch.cat(cand_depth, 1),
                                     torch.cat(cand_parent, 1), n)
        tokens = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=dev),
                            torch.gather(torch.cat(cand_tok, 1), 1, top)], 1)
        parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), par], 1)
        depth = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=dev), dep], 1)
        return DraftTree(tokens, parents, depth, ancestor_mask(parents)), None

    def _expand_meta(self, batch: ProposeBatch, f0: int, depth: int, fmask: torch.Tensor
                     ) -> tuple[torch.Tensor, AttentionMetadata]:
        """(positions [B*K], metadata) of one expansion: K nodes of this depth per request,
        input at position L-2+depth, KV at tree slots f0..f0+K-1 (positions L-1+f)."""
        K, F = self.cfg.topk, self.cfg.num_forwarded
        alloc = self.allocator
        positions, slots, tables, starts = [], [], [], []
        for s in batch.first_pass:
            root = s.start + s.length  # L-1: the root's position; tree slots start here
            starts.append(root)
            positions.extend([root - 1 + depth] * K)
            tables.append(alloc.tables[s.req_id])
            covered = len(alloc.tables[s.req_id]) * alloc.page_size
            # Slots past the request's blocks (the pool could not grow it) write nothing; such a
            # request's tree is never verified (TreeModelRunner.num_drafts_for).
            slots.extend(alloc.slot(s.req_id, root + f0 + i) if root + f0 + i < covered else -1
                         for i in range(K))
        b = len(starts)
        pos, meta = metadata_to_device(self.device, positions, slots, [r + F for r in starts],
                                       [i * K for i in range(b + 1)], tables, K,
                                       max(starts) + F)
        return pos, replace(meta, tree_start=meta.seq_lens - F,
                            tree_mask=fmask.reshape(b * K, F))
