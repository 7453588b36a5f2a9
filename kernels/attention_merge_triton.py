"""Merging the KV splits of the paged-attention kernel (``kernels.attention_triton``).

The default is the separate merge kernel below. ``COMPILED_SPEC_FUSED_MERGE=1``: the split that
finishes a tile last merges it, found through a per-tile counter kept here (one kernel per
attention); off until timed on the GPU in its current form (see ``kernels.attention_triton``).
A forced split count past the counters always takes the merge kernel. The counters and their
protocol (``last_to_arrive``, ``reset_counter``) also serve the row top-k's one-launch stage 2
(``kernels.topk_triton``).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Per device, one counter per (sequence, q block, KV head) tile of a split launch; every counter is
# back to 0 when a launch ends. A split launch has fewer programs than the GPU has SMs
# (``kernels.launch.splits_for``), so this many tiles cover every heuristic launch; a forced split
# count (tests, benchmarks) beyond it takes the separate merge kernel. Kept per device rather than
# allocated per call: zeroing a fresh buffer would be the extra kernel the fused merge removes.
COUNTER_SLOTS = 4096
_COUNTERS: dict[torch.device, torch.Tensor] = {}
FUSED_MERGE = os.environ.get("COMPILED_SPEC_FUSED_MERGE", "0") == "1"  # see the docstring


def split_counters(device: torch.device) -> torch.Tensor:  # [COUNTER_SLOTS] int32
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


# The two halves of "the last program to finish a piece of work completes it" (the attention
# split merge, the row top-k's stage 2), CUTLASS's semaphore pattern: every thread's stores
# are ordered by a CTA barrier before one gpu-scope release count; the program that makes the
# count ``arrivals`` acquires, and must then read the others' results through L2
# (``cache_modifier=".cg"``); it resets the counter for the next launch (and graph replay).
@triton.jit
def last_to_arrive(counter_ptr, arrivals):
    tl.debug_barrier()
    return tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == arrivals - 1


@triton.jit
def reset_counter(counter_ptr):
    tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["num_seqs", "stride_ls"],
            do_not_specialize_on_alignment=["query_start_loc_ptr"])  # kernels/launch.py
def _merge_splits_kernel(
    part_ptr, lse_ptr, out_ptr, query_start_loc_ptr, num_seqs,
    stride_ps, stride_pt, stride_ph, stride_ls, stride_lt, stride_ot, stride_oh,
    head_dim,
    NUM_SPLITS: tl.constexpr, DIM_PAD: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:  # launched with PDL (kernels.dispatch): wait for the attention, free the next
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)  # [S]
    d = tl.arange(0, DIM_PAD)  # [D]
    d_ok = d < head_dim
    # Tokens past the last sequence's (padding rows of a captured batch) belong to no program of
    # the attention kernel, so their lse and parts were never written (allocated uninitialised:
    # no fill kernel per layer); they get zeros, like the reference. Every owned token has an
    # lse from every split (-inf for an empty one). The ownership check and the lse load go out
    # together (one round trip, not two in a chain); the parts wait on the lse so that an empty
    # split's part (zeros, weight 0) is not read: loading every split's part with the lse cost
    # 8.5 us a step of the 8B decode (forty-eighth session, H100). An unowned row's garbage lse,
    # NaN included, reads no parts (its weights are set to 0).
    owned = tok < tl.load(query_start_loc_ptr + num_seqs)
    lse = tl.load(lse_ptr + s * stride_ls + tok * stride_lt + head)  # [S]
    m = tl.max(lse, 0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - m_safe), 0.0)  # [S]
    w = tl.where(owned, w, 0.0)  # an unowned row: no part read, zeros out
    part = tl.load(part_ptr + s[:, None] * stride_ps + tok * stride_pt + head * stride_ph
                   + d[None, :], mask=(w > 0.0)[:, None] & d_ok[None, :], other=0.0)  # [S, D]
    w_sum = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(w_sum > 0.0, w_sum, 1.0)  # [D]
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)
