"""Draft trees (EAGLE-2 style): configuration, node selection, ancestor masks (on device, fixed
shapes, no host sync), acceptance (on the host, from the step's one device-to-host copy) and KV
compaction.

Layout of one request's verification tree (N = num_draft_tokens nodes): node 0 is the root (the
last committed token, position L-1), nodes 1..N-1 are drafted tokens sorted by depth, so every
node's parent has a smaller index. Node j's KV is written at position L-1+j (its own slot in the
request's blocks: no page is shared between branches, so no partial page is copied per branch);
its rope position is L-1+depth(j). After verification the accepted path's KV is moved to the
positions L-1+1 .. L-1+a it belongs at (``compact_kv``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
        if self.num_candidates > 1 << 16 or self.num_steps > 255:  # select_nodes' key
            raise ValueError(f"speculative_topk={self.topk}, speculative_num_steps="
                             f"{self.num_steps}: {self.num_candidates} candidates of depth up "
                             "to num_steps; at most 65536 candidates and depth 255")

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


RANK_SELECT_MAX = 1024  # candidates up to which select_nodes ranks by pairs ([B, C, C] compares)


def select_nodes(scores: torch.Tensor,  # [B, C] cumulative log-probabilities
                 depth: torch.Tensor,  # [B, C] int64, >= 1
                 parent: torch.Tensor,  # [B, C] int64 candidate index, -1 = root
                 n: int,  # nodes to keep (num_draft_tokens - 1)
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's re-ranking: the n candidates of highest cumulative score. A child's score never
    exceeds its parent's, and ties go to the shallower node, so the set is closed under
    ancestors. Returns (chosen candidate ids [B, n] sorted by depth, their parents as tree
    indices [B, n] (0 = root, j = chosen[j-1]), depths [B, n])."""
    b, c = scores.shape  # c <= 65536 and depths < 256 (TreeConfig)
    # Rank by score, ties by depth, then by candidate id: one top-k over a unique int64 key,
    # not two stable sorts (on the H200 each was a ~26 us radix sort in every propose). The
    # score's bits, made order-preserving as an int32 (negative floats: magnitude bits
    # flipped; -0.0 first made +0.0), fill the high bits; depth (< 256) and id the low 24.
    bits = torch.where(scores == 0, torch.zeros_like(scores), scores).float().view(torch.int32)
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # [B, C] same order
    ids = torch.arange(c, device=scores.device)
    key = (ordered << 24) | ((255 - depth) << 16) | (65535 - ids)
    order = depth * (c + 1) + ids  # [B, C] verification order: by depth, then id (unique)
    if c <= RANK_SELECT_MAX:
        # By ranks, comparing every pair (the keys are unique): reductions Inductor fuses,
        # where the top-k, sort and scatter below are library kernels of their own (the top-k
        # alone took 9.2 us of each H200 tree proposal: results/2026-12-02_h200_session13/).
        chosen = (key[:, None, :] > key[:, :, None]).sum(-1) < n  # [B, C] among the n best
        # each chosen candidate's tree index - 1: the chosen ones before it in verification order
        slot = ((order[:, None, :] < order[:, :, None]) & chosen[:, None, :]).sum(-1)  # [B, C]
        hit = chosen[:, None, :] & (slot[:, None, :]
                                    == torch.arange(n, device=scores.device)[None, :, None])
        top = (hit * ids).sum(-1)  # [B, n]: the candidate at each tree index - 1
        tree_idx = torch.where(chosen, slot + 1, 0)  # [B, C] cand -> tree index (0: not chosen)
    else:
        top = key.topk(n, dim=1).indices  # [B, n]
        top = torch.gather(top, 1, torch.argsort(torch.gather(order, 1, top), dim=1))
        tree_idx = torch.zeros(b, c, dtype=torch.int64, device=scores.device)
        tree_idx.scatter_(1, top, torch.arange(1, n + 1, device=scores.device).expand(b, n))
    d_top = torch.gather(depth, 1, top)
    par = torch.gather(parent, 1, top)  # [B, n] candidate ids
    par_tree = torch.where(par < 0, torch.zeros_like(par),
                           torch.gather(tree_idx, 1, par.clamp(min=0)))
    return top, par_tree, d_top


def ancestor_mask(parents: torch.Tensor,  # [B, N] parent tree index (< own index), root -1
                  max_depth: int | None = None,  # the tree's depth (None: N - 1, always enough)
                  ) -> torch.Tensor:  # [B, N, N] bool: node i sees node j (ancestor or self)
    """Pointer jumping, one level per iteration: every node marks its ancestor at distance 1,
    2, ... up to ``max_depth`` at once (no host sync). The node-by-node pass this replaced was
    ~7 kernels per node (~217 for a 32-node tree, every propose). Each level ORs a comparison
    (its column == the ancestor's index) where it once scattered: Inductor fused part of each
    scatter and left the rest to ATen, 2 kernels per level on the H100 (thirty-eighth session's
    depth-4 trace), and a comparison fuses with the rest. Past the root an ancestor is the
    dummy index n, which matches no column."""
    b, n = parents.shape
    dev = parents.device
    col = torch.arange(n, device=dev)  # [N]
    anc = (col[None, :] == col[:, None])[None].expand(b, n, n)  # [B, N, N] each node itself
    # parents with the dummy node n appended, itself parentless: gathers past the root stay there
    cur = parents.where(parents >= 0, n)  # [B, N] each node's ancestor at the current distance
    up = torch.cat([cur, torch.full((b, 1), n, device=dev, dtype=parents.dtype)], 1)
    # (cur is not up[:, :n]: Inductor's unsqueeze of that strided slice guarded on B != 1, and
    # the tree's node selection compiled once for batch 1 and again for the other sizes)
    for _ in range(n - 1 if max_depth is None else max_depth):
        anc = anc | (cur[:, :, None] == col[None, None, :])
        cur = torch.gather(up, 1, cur)
    return anc.contiguous()  # (a view of the identity when there is no level)


def accept_paths(tokens: np.ndarray,  # [B, N] node tokens (root's unused)
                 parents: np.ndarray,  # [B, N] root -1
                 drawn: np.ndarray,  # [B, N] the token vanilla decoding draws after each node
                 depth: np.ndarray,  # [B, N] root 0
                 max_depth: int,
                 max_accept: np.ndarray | None = None,  # [B] cap (the request's budget)
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Follow, from the root, the child holding the token drawn at the current node. Returns
    (path [B, max_depth] tree indices, -1 past the end; accepted count [B]; the bonus token
    [B]: the one drawn at the last accepted node).

    On the host, from the step's one device-to-host copy: a handful of numpy operations on
    [B, N] ints, where the same walk on the device cost ~20 kernel launches per tree level. A
    node is accepted when its token is the one drawn at its parent and its parent is accepted
    (so, along the whole way up). Siblings hold distinct tokens (top-k children), so the
    accepted nodes form one path, one per depth.

    Up to ``WALK_MAX_BATCH`` trees take ``accept_walk`` instead (same result): a few dict
    lookups per tree cost less host time than ~25 numpy calls of fixed overhead each."""
    b, n = tokens.shape
    if b <= WALK_MAX_BATCH:
        return accept_walk(tokens, parents, drawn, max_depth, max_accept)
    # Fancy indexing, not np.take_along_axis: the same gather at half the host time (its index
    # building dominates at these sizes, 25 -> 13 us per 32-node tree on the CPU).
    rows = np.arange(b)[:, None]  # [B, 1]
    up = np.maximum(parents, 0)  # the root is its own parent here (and always accepted)
    ok = tokens == drawn[rows, up]  # [B, N]
    if max_accept is not None:
        ok &= depth <= max_accept[:, None]
    ok[:, 0] = True
    # Accepted = ok along the whole way up: one pass per level (max_depth), not per node (~N),
    # so the walk costs ~13 us of host time for a 32-node tree instead of ~65 (a tree step's
    # acceptance runs on the host between the verify and the next proposal).
    accepted = ok
    for _ in range(max_depth - 1):
        accepted = ok & accepted[rows, up]
    accepted[:, 0] = False
    n_acc = accepted.sum(axis=1)
    path = np.full((b, max_depth + 1), -1, dtype=np.int64)
    path[:, 0] = 0  # column d holds the accepted node of depth d; column 0 the root
    r, c = np.nonzero(accepted)
    path[r, depth[r, c]] = c
    last = path[rows[:, 0], n_acc]  # the deepest accepted node (the root if none)
    bonus = drawn[rows[:, 0], last]
    return path[:, 1:], n_acc, bonus


# Up to here the walk is faster (CPU: 7.7 vs 15.9 us for one 32-node tree, 22.7 vs 18.1 for 4).
WALK_MAX_BATCH = 2


def accept_walk(tokens: np.ndarray, parents: np.ndarray, drawn: np.ndarray,  # [B, N] each
                max_depth: int, max_accept: np.ndarray | None = None,  # [B]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``accept_paths`` by walking each tree from its root: the child keyed by (parent, token)
    holding the token drawn at the current node, until none does or the budget is reached.
    For the small batches of latency-bound serving, where a tree step's acceptance sits
    between the host copy and the next launch, with the GPU idle."""
    b = tokens.shape[0]
    path = np.full((b, max_depth), -1, dtype=np.int64)
    n_acc = np.zeros(b, dtype=np.int64)
    bonus = np.zeros(b, dtype=drawn.dtype)
    caps = [max_depth] * b if max_accept is None else np.minimum(max_accept, max_depth).tolist()
    for r, (tok, par, drw) in enumerate(zip(tokens.tolist(), parents.tolist(), drawn.tolist())):
        child = {(p, t): j for j, (p, t) in enumerate(zip(par, tok)) if j}
        node, k = 0, 0
        while k < caps[r]:
            nxt = child.get((node, drw[node]))
            if nxt is None:
                break
            path[r, k], node, k = nxt, nxt, k + 1
        n_acc[r], bonus[r] = k, drw[node]
    return path, n_acc, bonus


def compact_kv(caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [blocks, page, H, D]
               src: list[int], dst: list[int],  # KV slots: accepted node -> its final position
               ) -> None:
    """Move each accepted node's KV to the position of its depth, in every layer: one upload
    of the slot pairs (computed on the host from the block tables, only for nodes off their
    place) and two kernels per cache tensor, or nothing when no node moves. All sources are
    read before any write, so overlapping moves are safe.

    The layers' caches are separate tensors on purpose: as views of one pool, a single pair of
    kernels would move every layer, but torch.compile treats inputs sharing storage as aliases
    and copied the whole pool for each layer's KV write (measured on the CPU, 2026-12-01)."""
    if not src:
        return
    move_slots(caches, _slot_pairs(caches, src, dst))


def _slot_pairs(caches: list[tuple[torch.Tensor, torch.Tensor]], src: list[int],
                dst: list[int]) -> torch.Tensor:
    """[2, M] int64 source then destination slots, uploaded to the caches' device."""
    return torch.tensor([src, dst], dtype=torch.int64).to(caches[0][0].device, non_blocking=True)


def move_slots(caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer [blocks, page, H, D]
               idx: torch.Tensor,  # [2, M] source then destination slots, on the device
               ) -> None:
    """``compact_kv`` with the slots on the device: per cache tensor a gather of every source,
    then a scatter (all read before any write)."""
    for k_cache, v_cache in caches:
        for cache in (k_cache, v_cache):
            flat = cache.view(-1, *cache.shape[2:])  # [slots, H, D]
            flat.index_copy_(0, idx[1], flat.index_select(0, idx[0]))


class KVCompactor:
    """``compact_kv`` in one launch for every layer on a GPU: a Triton kernel over a table of
    the caches' addresses (``kernels.move_kv_triton``), built once per set of caches. Elsewhere
    (or with ``use_kernel=False``) the per-layer gathers and scatters of ``compact_kv``."""

    def __init__(self, use_kernel: bool | None = None) -> None:
        self.use_kernel = use_kernel  # None: on CUDA tensors
        self._ptrs: tuple[int, ...] = ()
        self._table: torch.Tensor | None = None  # [2 * layers] int64 cache addresses

    def __call__(self, caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V)
                 src: list[int], dst: list[int]) -> None:
        if src:
            self.move(caches, _slot_pairs(caches, src, dst))

    def move(self, caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (K, V)
             idx: torch.Tensor,  # [2, M] int64 source then destination slots, on the device
             ) -> None:
        """The moves with their slots already on the device (fixed M: capturable once the
        kernel's table exists; the early tree graph's warm-up builds it). Destinations must be
        distinct, except self-moves of one slot (every copy writes the same value)."""
        k0 = caches[0][0]
        if not (k0.is_cuda if self.use_kernel is None else self.use_kernel):
            move_slots(caches, idx)
            return
        from kernels.move_kv_triton import cache_table, move_slots_triton

        flat = [c for kv in caches for c in kv]
        ptrs = tuple(c.data_ptr() for c in flat)
        if ptrs != self._ptrs:  # first use, or the engine's pool was rebound
            if self._table is None:
                _check_kernel(k0)
            self._table, self._ptrs = cache_table(flat), ptrs
        move_slots_triton(self._table, k0, idx)


def _check_kernel(like: torch.Tensor) -> None:
    """Before the first real move: the kernel against ``compact_kv`` on two small caches of the
    real ones' dtype and device, with moves that overlap (a slot read by one move is written by
    the next). A wrong move would corrupt the target's KV and so the output, silently: this
    turns it into an error at the engine's first tree step."""
    from kernels.move_kv_triton import cache_table, move_slots_triton

    g = torch.Generator().manual_seed(0)
    shape = (8, *like.shape[1:])  # [blocks, page, H, D]: keys and values of one layer
    k, v = (torch.randn(shape, generator=g).to(like.device, like.dtype) for _ in range(2))
    got = [k.clone(), v.clone()]
    src, dst = [2, 3, 5], [1, 2, 4]  # slot 2 is read by the first move, written by the second
    compact_kv([(k, v)], src, dst)
    move_slots_triton(cache_table(got), got[0], torch.tensor([src, dst], device=like.device))
    if not (torch.equal(k, got[0]) and torch.equal(v, got[1])):
        raise RuntimeError(f"the KV move kernel disagrees with the per-layer moves on "
                           f"{like.dtype} {like.device}: draft trees cannot run exactly here")
    warm_move_tiles(like)


def warm_move_tiles(like: torch.Tensor) -> None:
    """Compile (or load) the kernel's variant of every move-count class now, at start-up, not in
    the first serving step whose moves fall in a new class (self-moves on a scratch cache)."""
    from kernels.move_kv_triton import MOVE_TILES, cache_table, move_slots_triton

    page = like.shape[1]
    blocks = -(-MOVE_TILES[-2] // page)  # the classes up to 256 moves: a step's own range
    scratch = torch.zeros((blocks, *like.shape[1:]), dtype=like.dtype, device=like.device)
    table = cache_table([scratch])
    for m in MOVE_TILES[:-1]:
        slots = torch.arange(m, device=like.device)
        move_slots_triton(table, scratch, torch.stack([slots, slots]))
