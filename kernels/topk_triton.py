"""Triton top-k along rows for small k (the draft tree's candidates): the k largest of each row,
ties to the smaller index, values descending. Same result as ``kernels.ops.row_topk_ref``.

Why not ``torch.topk``: on the H200 a top-8 over [8, 32768] draft log-probabilities ran as a
multi-block radix select of ~8 kernels and ~35 us, five times in every tree proposal
(results/2026-12-01_h200_session7/trees.log). Here: stage 1, one program per (row, chunk of
BLOCK) keeps its chunk's k best by k rounds of max + smallest matching index; stage 2, one
program per row, the same over the chunks' winners (their original indices break ties). Two
launches; one when a row fits a single chunk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BIG = tl.constexpr(2**31 - 1)  # the index of "no element": loses every tie


@triton.jit
def _chunk_topk(x_ptr, val_ptr, idx_ptr, n, stride_x, out_stride,
                K: tl.constexpr, BLOCK: tl.constexpr, HAS_IDX: tl.constexpr, idx_in_ptr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=-float("inf")).to(tl.float32)
    if HAS_IDX:  # stage 2: the candidates carry their original indices
        ix = tl.load(idx_in_ptr + row * stride_x + offs, mask=valid, other=_BIG).to(tl.int32)
    else:
        ix = tl.where(valid, offs, _BIG)
    taken = offs >= n
    base = row * out_stride + chunk * K
    for j in tl.static_range(K):
        m = tl.max(tl.where(taken, -float("inf"), x), 0)
        i = tl.min(tl.where((~taken) & (x == m), ix, _BIG), 0)
        tl.store(val_ptr + base + j, m)
        tl.store(idx_ptr + base + j, i.to(tl.int64))
        taken = taken | (ix == i)


def row_topk_triton(x: torch.Tensor,  # [R, N] float, N >= k
                    k: int, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [R, k] float32 descending, indices [R, k] int64)."""
    r, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    vals = torch.empty(r, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(r, k, dtype=torch.int64, device=x.device)
    if r == 0:
        return vals, idx
    block = min(block, triton.next_power_of_2(n))
    chunks = triton.cdiv(n, block)
    if chunks == 1:  # one chunk per row: its winners are the answer
        _chunk_topk[(r, 1)](x, vals, idx, n, x.stride(0), k, K=k, BLOCK=block,
                            HAS_IDX=False, idx_in_ptr=x)
        return vals, idx
    v1 = torch.empty(r, chunks * k, dtype=torch.float32, device=x.device)
    i1 = torch.empty(r, chunks * k, dtype=torch.int64, device=x.device)
    _chunk_topk[(r, chunks)](x, v1, i1, n, x.stride(0), chunks * k, K=k, BLOCK=block,
                             HAS_IDX=False, idx_in_ptr=x)
    m = chunks * k
    _chunk_topk[(r, 1)](v1, vals, idx, m, m, k, K=k, BLOCK=triton.next_power_of_2(m),
                        HAS_IDX=True, idx_in_ptr=i1)
    return vals, idx
