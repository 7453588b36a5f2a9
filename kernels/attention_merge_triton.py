"""Merging the split-KV ("flash-decoding") partials of ``kernels.attention_triton``.

Each KV split of a (sequence, query block, KV head) writes a partial output normalised by its own
softmax sum, and that sum's base-2 log-sum-exp (-inf for a split that saw no key). The final row
is the lse-weighted mean of the partials. Two ways to get there:

* ``_merge_splits_kernel``: a second launch, one program per (token, query head). The original
  path, kept behind ``FUSED_SPLIT_MERGE`` / ``fused_merge=False`` until GPU timings settle it.
* "last split merges" (``merge_split_partials``, called from the attention kernel): every split
  bumps an int32 arrival counter of its (sequence, query block, KV head) after writing its
  partial, and the program that arrives last merges all of them and zeroes the counter again.
  A CUDA graph replays that launch with the counter already back at 0, so no memset node is
  needed; inside a graph each launch costs ~1-2 us however small it is, and the merge was one
  launch per layer.

The counters live in one zero-initialised buffer per device (``split_counters``), allocated at
the first split launch (engine start-up warm-up, before any capture) and never freed: captured
graphs bake its address in. Launches sharing it must be stream-ordered, which the engine's
single compute stream gives.
"""
from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl

MIN_COUNTERS = 4096  # programs per split launch stay below the SM count; this is 16 KiB
# fp32 elements of one [chunk, rows, dim] partial tile in the fused merge: 32 registers a thread
# at 4 warps. 8192 made ptxas spill in the 64-row (prefill block) sm_90 build; 4096 keeps the
# decode build at the old kernel's 168 registers.
MERGE_TILE = 4096

_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: a captured graph may still point at them


def split_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """The device's arrival counters ([>= needed] int32, all 0 between launches), or None while
    a CUDA graph is being captured and the buffer is missing or too small (an allocation then
    would come from the graph's private pool and its zeroing would be captured too): the caller
    takes the two-kernel path instead. Outside capture it allocates or grows."""
    index = device.index if device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else 0)
    key = (device.type, index)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= needed:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        warnings.warn("paged attention: split arrival counters missing or too small inside a "
                      "CUDA-graph capture; this graph uses the two-kernel split merge")
        return None
    if buf is not None:
        _RETIRED.append(buf)
    size = max(needed, MIN_COUNTERS, 2 * buf.numel() if buf is not None else 0)
    buf = torch.zeros(size, dtype=torch.int32, device=torch.device(device.type, index))
    _COUNTERS[key] = buf
    return buf


def merge_chunk(num_splits: int, rows: int, dim_pad: int) -> int:
    """Splits per partial tile the fused merge loads at once: a power of two dividing
    ``num_splits``, so the merging program issues one wide load per chunk instead of a chain of
    dependent per-split round trips to L2."""
    chunk = 1
    while chunk * 2 <= num_splits and chunk * 2 * rows * dim_pad <= MERGE_TILE:
        chunk *= 2
    return chunk


@triton.jit
def merge_split_partials(
    part_ptr, lse_ptr,
    row_off,  # [M] int64: token * stride_pt + head * stride_ph of each score row
    lse_off,  # [M] int64: token * stride_lt + head
    row_ok,  # [M] rows that exist (token in range, head in group)
    d, d_ok,  # [D]
    stride_ps, stride_ls,
    M: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr,
):  # -> [M, D] fp32
    # Same arithmetic as _merge_splits_kernel: weights exp2(lse - max lse), empty splits (lse
    # -inf) weigh 0, rows with no key anywhere come out 0. .cg loads: the partials were written
    # by other SMs; L2 is the coherence point, L1 is not.
    s = tl.arange(0, NUM_SPLITS)  # [S]
    lse = tl.load(lse_ptr + s[:, None] * stride_ls + lse_off[None, :], mask=row_ok[None, :],
                  other=float("-inf"), cache_modifier=".cg")  # [S, M]
    m = tl.max(lse, 0)  # [M]
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    w_sum = tl.sum(tl.where(lse > float("-inf"), tl.exp2(lse - m_safe[None, :]), 0.0), 0)  # [M]
    acc = tl.zeros([M, DIM_PAD], tl.float32)  # [M, D]
    for c in range(0, NUM_SPLITS, CHUNK):
        sc = c + tl.arange(0, CHUNK)  # [C]
        lse_c = tl.load(lse_ptr + sc[:, None] * stride_ls + lse_off[None, :],
                        mask=row_ok[None, :], other=float("-inf"), cache_modifier=".cg")  # [C, M]
        w = tl.where(lse_c > float("-inf"), tl.exp2(lse_c - m_safe[None, :]), 0.0)  # [C, M]
        mask = (w > 0.0)[:, :, None] & d_ok[None, None, :]
        part = tl.load(part_ptr + sc[:, None, None] * stride_ps + row_off[None, :, None]
                       + d[None, None, :], mask=mask, other=0.0,
                       cache_modifier=".cg")  # [C, M, D]
        acc += tl.sum(part * w[:, :, None], 0)
    return acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]


@triton.jit(do_not_specialize=["num_seqs", "stride_ls"])
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, query_start_loc_ptr, num_seqs,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    head_dim,
    NUM_SPLITS: tl.constexpr, DIM_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)  # [S]
    d = tl.arange(0, DIM_PAD)  # [D]
    d_ok = d < head_dim
    # Tokens past the last sequence's (padding rows of a captured batch) belong to no program of
    # the attention kernel, so their lse was never written (lse is allocated uninitialised: no
    # fill kernel per layer); they get zeros, like the reference. Every owned token has an lse
    # from every split (-inf for an empty one).
    if tok >= tl.load(query_start_loc_ptr + num_seqs):
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + d,
                 tl.zeros([DIM_PAD], tl.float32).to(out_ptr.dtype.element_ty), mask=d_ok)
        return
    lse = tl.load(lse_ptr + s * stride_ls + tok * stride_lt + head)  # [S]
    m = tl.max(lse, 0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m_safe), 0.0)  # [S]
    part = tl.load(part_ptr + s[:, None] * stride_ps + tok * stride_pt + head * stride_ph
                   + d[None, :], mask=(w > 0.0)[:, None] & d_ok[None, :], other=0.0)  # [S, D]
    w_sum = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(w_sum > 0.0, w_sum, 1.0)  # unowned -> 0
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)
