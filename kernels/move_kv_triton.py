"""Move KV slots in every layer at once: one launch for all the layers' key and value caches.

After a draft-tree step the accepted nodes' KV moves from their tree slots to the positions of
their depths. Per layer that is a gather and a scatter for keys and values: 4 launches x 30
layers on SmolLM2, the largest part of a tree step's host work (H200, 2026-12-01). Here one
program owns one cache tensor (found through a table of their addresses, as vLLM's copy_blocks
does) and a slice of every slot row; it loads every source before storing any destination, so
moves whose destination is another move's source are safe, as in the gather-then-scatter it
replaces.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n_moves"])
def _move_slots_kernel(
    ptrs_ptr,  # [num_caches] int64: each cache's address
    like_ptr,  # any one cache: only its element type is read (the table's pointers are ints)
    idx_ptr,  # [2, n_moves] int64: source slots, then destination slots
    n_moves, row,  # row: elements per slot (kv heads x head dim)
    M_PAD: tl.constexpr, BLOCK: tl.constexpr,
):
    cache = tl.load(ptrs_ptr + tl.program_id(0)).to(tl.pointer_type(like_ptr.dtype.element_ty))
    m = tl.arange(0, M_PAD)
    m_ok = m < n_moves
    src = tl.load(idx_ptr + m, mask=m_ok, other=0)
    dst = tl.load(idx_ptr + n_moves + m, mask=m_ok, other=0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = m_ok[:, None] & (col < row)[None, :]
    vals = tl.load(cache + src[:, None] * row + col[None, :], mask=ok)  # every source first
    tl.store(cache + dst[:, None] * row + col[None, :], vals, mask=ok)


# Move-count classes, each one compiled variant of the kernel (M_PAD): few enough to compile all
# at start-up (``spec.tree._check_kernel``). Per power of two, a late tree step whose move count
# fell in a class not met before compiled it mid-serving: 55-170 ms each on the H200 with an
# empty Triton cache (eighteenth session). Masked lanes cost next to nothing here.
MOVE_TILES = (16, 64, 256, 1024)


def move_tile(n_moves: int) -> int:
    """The M_PAD a move count runs with: the smallest class holding it, else a power of two."""
    return next((t for t in MOVE_TILES if n_moves <= t), triton.next_power_of_2(n_moves))


def cache_table(caches: list[torch.Tensor]) -> torch.Tensor:
    """The caches' addresses on their device ([num_caches] int64), after checking that one
    kernel may treat them alike: same shape, dtype and device, contiguous."""
    c0 = caches[0]
    for c in caches:
        if c.shape != c0.shape or c.dtype != c0.dtype or c.device != c0.device:
            raise ValueError(f"KV caches differ: {tuple(c.shape)} {c.dtype} {c.device} vs "
                             f"{tuple(c0.shape)} {c0.dtype} {c0.device}")
        if not c.is_contiguous():
            raise ValueError("KV caches must be contiguous to move slots by address")
    return torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=c0.device)


def move_slots_triton(table: torch.Tensor,  # [num_caches] int64 from cache_table
                      like: torch.Tensor,  # [num_blocks, page_size, H, D] one of the caches
                      idx: torch.Tensor,  # [2, n_moves] int64 on the caches' device
                      ) -> None:
    """cache.view(slots, -1)[idx[1]] = cache.view(slots, -1)[idx[0]] for every cache of the
    table, sources read before destinations are written."""
    n_moves = idx.shape[1]
    if n_moves == 0:
        return
    row = like[0, 0].numel()
    m_pad = move_tile(n_moves)
    # A tile of at most 4k elements per program: registers, not spills, at any batch.
    block = max(16, min(triton.next_power_of_2(row), 4096 // m_pad))
    grid = (table.numel(), triton.cdiv(row, block))
    _move_slots_kernel[grid](table, like, idx.contiguous(), n_moves, row, M_PAD=m_pad,
                             BLOCK=block)
