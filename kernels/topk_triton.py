"""Triton top-k along rows for small k (the draft tree's candidates): the k largest of each row,
ties to the smaller index, values descending. Same result as ``kernels.ops.row_topk_ref``.

Why not ``torch.topk``: on the H200 a top-8 over [8, 32768] draft log-probabilities ran as a
multi-block radix select of ~8 kernels and ~35 us, five times in every tree proposal
(results/2026-12-01_h200_session7/trees.log). Here: stage 1, one program per (row, chunk of
BLOCK) keeps its chunk's k best by k rounds of max + smallest matching index; stage 2, one
program per row, the same over the chunks' winners (their original indices break ties). Two
launches; one when a row fits a single chunk. By default (``COMPILED_SPEC_FUSED_TOPK=0``
turns it off) stage 2 runs in stage 1's launch: the chunk program that finishes a row last (a
per-row atomic counter, ``kernels.attention_merge_triton``'s protocol) selects over the row's
chunk winners. One launch per top-k instead of two: on the H200 (fourteenth session) 9 launches
at 5.3 us per 8/32 tree proposal against 14 at 3.3 us, the same GPU time in 5 fewer launches.
``logprob=True`` (``kernels.ops.row_topk_logprob``): the values become log-probabilities, each
chunk's (max, sum of exp) combined into the row's logsumexp where stage 2 runs.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.attention_merge_triton import (COUNTER_SLOTS, last_to_arrive, reset_counter,
                                            split_counters)

FUSED_TOPK = os.environ.get("COMPILED_SPEC_FUSED_TOPK", "1") != "0"

_BIG = tl.constexpr(2**31 - 1)  # the index of "no element": loses every tie


@triton.jit
def _select(x, ix, taken, val_ptr, idx_ptr, base, shift, K: tl.constexpr):
    """The K best of ``x`` not yet ``taken`` (ties to the smaller ``ix``), stored from ``base``
    less ``shift`` (the row's logsumexp for log-probabilities, else 0)."""
    for j in tl.static_range(K):
        m = tl.max(tl.where(taken, -float("inf"), x), 0)
        i = tl.min(tl.where((~taken) & (x == m), ix, _BIG), 0)
        tl.store(val_ptr + base + j, m - shift)
        tl.store(idx_ptr + base + j, i.to(tl.int64))
        taken = taken | (ix == i)


@triton.jit
def _row_lse(m_ptr, s_ptr, row, n_stats, BLOCK3: tl.constexpr):
    """A row's logsumexp from its chunks' (max, sum of exp(x - max)), written by stage 1."""
    o = tl.arange(0, BLOCK3)
    ok = o < n_stats
    m = tl.load(m_ptr + row * n_stats + o, mask=ok, other=-float("inf"), cache_modifier=".cg")
    s = tl.load(s_ptr + row * n_stats + o, mask=ok, other=0.0, cache_modifier=".cg")
    top = tl.max(m, 0)
    return top + tl.log(tl.sum(tl.where(ok, s * tl.exp(m - top), 0.0), 0))


@triton.jit
def _chunk_topk(x_ptr, val_ptr, idx_ptr, n, stride_x, out_stride,
                K: tl.constexpr, BLOCK: tl.constexpr, HAS_IDX: tl.constexpr, idx_in_ptr,
                fin_val_ptr, fin_idx_ptr, counter_ptr,
                MERGE: tl.constexpr, BLOCK2: tl.constexpr,
                LSE: tl.constexpr, ONE_CHUNK: tl.constexpr, m_ptr, s_ptr, n_stats,
                BLOCK3: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=valid, other=-float("inf")).to(tl.float32)
    if HAS_IDX:  # stage 2: the candidates carry their original indices
        ix = tl.load(idx_in_ptr + row * stride_x + offs, mask=valid, other=_BIG).to(tl.int32)
    else:
        ix = tl.where(valid, offs, _BIG)
    shift = 0.0
    if LSE:  # log-probabilities: the row's logsumexp, from this chunk's or stage 1's stats
        if HAS_IDX:
            shift = _row_lse(m_ptr, s_ptr, row, n_stats, BLOCK3)
        else:
            cm = tl.max(x, 0)
            # a chunk of -inf alone (a masked vocabulary) adds nothing, and no NaN
            cs = tl.sum(tl.where(x > -float("inf"), tl.exp(x - cm), 0.0), 0)
            if ONE_CHUNK:
                shift = cm + tl.log(cs)
            else:
                tl.store(m_ptr + row * n_stats + chunk, cm)
                tl.store(s_ptr + row * n_stats + chunk, cs)
    _select(x, ix, offs >= n, val_ptr, idx_ptr, row * out_stride + chunk * K, shift, K)
    if MERGE:  # stage 2 by the row's last chunk to finish (last_to_arrive)
        if last_to_arrive(counter_ptr + row, tl.num_programs(1)):
            m_n = tl.num_programs(1) * K
            offs2 = tl.arange(0, BLOCK2)
            ok2 = offs2 < m_n
            x2 = tl.load(val_ptr + row * out_stride + offs2, mask=ok2, other=-float("inf"),
                         cache_modifier=".cg")
            ix2 = tl.load(idx_ptr + row * out_stride + offs2, mask=ok2, other=_BIG,
                          cache_modifier=".cg").to(tl.int32)
            shift2 = 0.0
            if LSE:
                shift2 = _row_lse(m_ptr, s_ptr, row, n_stats, BLOCK3)
            _select(x2, ix2, offs2 >= m_n, fin_val_ptr, fin_idx_ptr, row * K, shift2, K)
            reset_counter(counter_ptr + row)


def row_topk_triton(x: torch.Tensor,  # [R, N] float, N >= k
                    k: int, block: int = 1024, fused: bool | None = None,  # None: FUSED_TOPK
                    logprob: bool = False,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [R, k] float32 descending, indices [R, k] int64). ``logprob``: the values are
    log_softmax(x)'s, the row's logsumexp taken from the same chunks in the same launches (the
    draft tree's scores without a materialized [R, N] log-softmax: its 5 kernels per expansion
    on the H100, results/2026-12-05_h100_session36/)."""
    r, n = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    vals = torch.empty(r, k, dtype=torch.float32, device=x.device)
    idx = torch.empty(r, k, dtype=torch.int64, device=x.device)
    if r == 0:
        return vals, idx
    block = min(block, triton.next_power_of_2(n))
    chunks = triton.cdiv(n, block)
    lse = dict(LSE=logprob, ONE_CHUNK=chunks == 1, n_stats=chunks,
               BLOCK3=triton.next_power_of_2(chunks))
    if logprob and chunks > 1:  # each chunk's (max, sum of exp(x - max)) for the row's lse
        lse.update(m_ptr=torch.empty(r, chunks, dtype=torch.float32, device=x.device),
                   s_ptr=torch.empty(r, chunks, dtype=torch.float32, device=x.device))
    else:
        lse.update(m_ptr=vals, s_ptr=vals)  # unread
    unused = dict(fin_val_ptr=vals, fin_idx_ptr=idx, counter_ptr=idx, MERGE=False, BLOCK2=1)
    if chunks == 1:  # one chunk per row: its winners are the answer
        _chunk_topk[(r, 1)](x, vals, idx, n, x.stride(0), k, K=k, BLOCK=block,
                            HAS_IDX=False, idx_in_ptr=x, **unused, **lse)
        return vals, idx
    m = chunks * k
    v1 = torch.empty(r, m, dtype=torch.float32, device=x.device)
    i1 = torch.empty(r, m, dtype=torch.int64, device=x.device)
    merge = (FUSED_TOPK if fused is None else fused) and r <= COUNTER_SLOTS
    _chunk_topk[(r, chunks)](x, v1, i1, n, x.stride(0), m, K=k, BLOCK=block,
                             HAS_IDX=False, idx_in_ptr=x, fin_val_ptr=vals, fin_idx_ptr=idx,
                             counter_ptr=split_counters(x.device) if merge else idx,
                             MERGE=merge, BLOCK2=triton.next_power_of_2(m), **lse)
    if not merge:
        _chunk_topk[(r, 1)](v1, vals, idx, m, m, k, K=k, BLOCK=triton.next_power_of_2(m),
                            HAS_IDX=True, idx_in_ptr=i1, **unused, **lse)
    return vals, idx
