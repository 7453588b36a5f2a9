"""Draft trees (EAGLE-2 style): configuration, node selection, ancestor masks, greedy acceptance
and KV compaction. All on device with fixed shapes: no host sync.

Layout of one request's verification tree (N = num_draft_tokens nodes): node 0 is the root (the
last committed token, position L-1), nodes 1..N-1 are drafted tokens sorted by depth, so every
node's parent has a smaller index. Node j's KV is written at position L-1+j (its own slot in the
request's blocks: no page is shared between branches, so no partial page is copied per branch);
its rope position is L-1+depth(j). After verification the accepted path's KV is moved to the
positions L-1+1 .. L-1+a it belongs at (``compact_kv``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TreeConfig:
    topk: int  # children per expanded node, and nodes expanded per step
    num_steps: int  # draft forward passes (tree depth)
    num_draft_tokens: int  # verification budget, root included

    def __post_init__(self) -> None:
        for name in ("topk", "num_steps", "num_draft_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"speculative_{name}={v!r}: must be a positive integer")
        if not 2 <= self.num_draft_tokens <= 1 + self.num_candidates:
            raise ValueError(f"speculative_num_draft_tokens={self.num_draft_tokens}: must be in "
                             f"[2, 1 + {self.num_candidates}] (the root plus the tree's "
                             f"topk + (num_steps - 1) * topk^2 candidates)")

    @property
    def num_candidates(self) -> int:
        return self.topk + (self.num_steps - 1) * self.topk * self.topk

    @property
    def num_forwarded(self) -> int:
        """Draft nodes run through the draft (the expanded frontiers of steps 2..num_steps)."""
        return (self.num_steps - 1) * self.topk

    @property
    def lookahead(self) -> int:
        """Positions past the last committed one a tree step may write (target or draft)."""
        return max(self.num_draft_tokens, self.num_forwarded + 1)


def select_nodes(scores: torch.Tensor,  # [B, C] cumulative log-probabilities
                 depth: torch.Tensor,  # [B, C] int64, >= 1
                 parent: torch.Tensor,  # [B, C] int64 candidate index, -1 = root
                 n: int,  # nodes to keep (num_draft_tokens - 1)
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's re-ranking: the n candidates of highest cumulative score. A child's score never
    exceeds its parent's, and ties go to the shallower node, so the set is closed under
    ancestors. Returns (chosen candidate ids [B, n] sorted by depth, their parents as tree
    indices [B, n] (0 = root, j = chosen[j-1]), depths [B, n])."""
    b, c = scores.shape
    # Rank by score, ties by depth: a sort on depth, then a stable sort on score.
    by_depth = torch.argsort(depth, dim=1, stable=True)
    s_sorted = torch.gather(scores, 1, by_depth)
    order = torch.gather(by_depth, 1, torch.argsort(-s_sorted, dim=1, stable=True))
    top = order[:, :n]  # [B, n]
    d_top = torch.gather(depth, 1, top)
    # Verification order: by depth, then candidate id (stable), so parents come first.
    top = torch.gather(top, 1, torch.argsort(d_top * (c + 1) + top, dim=1))
    d_top = torch.gather(depth, 1, top)
    tree_idx = torch.zeros(b, c, dtype=torch.int64, device=scores.device)  # cand -> tree index
    tree_idx.scatter_(1, top, torch.arange(1, n + 1, device=scores.device).expand(b, n))
    par = torch.gather(parent, 1, top)  # [B, n] candidate ids
    par_tree = torch.where(par < 0, torch.zeros_like(par),
                           torch.gather(tree_idx, 1, par.clamp(min=0)))
    return top, par_tree, d_top


def ancestor_mask(parents: torch.Tensor,  # [B, N] parent tree index (< own index), root -1
                  ) -> torch.Tensor:  # [B, N, N] bool: node i sees node j (ancestor or self)
    """Row i = row parent(i) plus i itself; parents precede children, so one pass in index
    order builds every row (no host sync)."""
    b, n = parents.shape
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).repeat(b, 1, 1)
    for i in range(1, n):
        p = parents[:, i].clamp(min=0)  # [B]
        row = torch.gather(anc, 1, p[:, None, None].expand(b, 1, n))[:, 0]  # [B, N]
        anc[:, i] |= row & (parents[:, i] >= 0)[:, None]
    return anc


def greedy_accept(tokens: torch.Tensor,  # [B, N] node tokens (root's unused)
                  parents: torch.Tensor,  # [B, N] root -1
                  target_top: torch.Tensor,  # [B, N] target argmax at each node
                  depth: torch.Tensor,  # [B, N] int64, root 0
                  mask: torch.Tensor,  # [B, N, N] bool ancestor-or-self
                  max_depth: int,
                  max_accept: torch.Tensor | None = None,  # [B] cap (the request's budget)
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Follow, from the root, the child whose token is the target's argmax at the current node.
    Returns (path [B, max_depth] tree indices, -1 past the end; accepted count [B]; the bonus
    token [B]: the target's argmax at the last accepted node).

    One shot instead of a walk per depth (a constant ~20 kernels, not ~20 per level): a node is
    accepted when it and every ancestor below the root match the target's argmax at their
    parent. Siblings hold distinct tokens (top-k children), so the accepted nodes form one path
    with one node per depth."""
    b, n = tokens.shape
    idx = torch.arange(n, device=tokens.device)[None, :]  # [1, N]
    ok = (tokens == torch.gather(target_top, 1, parents.clamp(min=0))) | (idx == 0)  # [B, N]
    if max_accept is not None:
        ok = ok & (depth <= max_accept[:, None])
    accepted = ~(mask & ~ok[:, None, :]).any(dim=2)  # [B, N] root included
    drafts = accepted & (idx > 0)
    n_acc = drafts.sum(dim=1)
    # Column depth-1 of the path holds the accepted node of that depth.
    cols = torch.where(drafts, depth, torch.zeros_like(depth))  # column 0 = discard
    path = torch.full((b, max_depth + 1), -1, dtype=torch.int64, device=tokens.device)
    path = path.scatter_reduce(1, cols, torch.where(drafts, idx, -1), "amax")[:, 1:]
    last = torch.where(accepted, depth, -1).argmax(dim=1, keepdim=True)  # [B, 1] deepest
    bonus = torch.gather(target_top, 1, last)[:, 0]
    return path, n_acc, bonus


def compact_kv(pool: torch.Tensor,  # [L, 2, num_blocks, page, H, D]: every layer's (k, v)
               block_tables: torch.Tensor,  # [B, W] int32
               base: torch.Tensor,  # [B] int64 root position L-1
               path: torch.Tensor,  # [B, D] accepted tree indices, -1 past the end
               ) -> None:
    """Move each accepted node's KV from position base + node to base + depth, for every layer
    at once (two kernels on the whole pool, not two per layer and tensor). All sources are read
    before any write, so overlapping moves are safe; rows past the path copy a slot onto
    itself."""
    if path.numel() == 0:
        return
    num_layers, two, num_blocks, page = pool.shape[:4]
    b, d = path.shape
    depth = torch.arange(1, d + 1, device=path.device).expand(b, d)
    dst_pos = base[:, None] + depth
    src_pos = torch.where(path >= 0, base[:, None] + path, dst_pos)

    def slot(pos: torch.Tensor) -> torch.Tensor:
        blk = torch.gather(block_tables.to(torch.int64), 1, pos // page)
        return (blk * page + pos % page).reshape(-1)

    src, dst = slot(src_pos), slot(dst_pos)
    flat = pool.view(num_layers * two, num_blocks * page, -1)  # [2L, slots, H*D]
    flat.index_copy_(1, dst, flat.index_select(1, src))
