"""Triton KV write: one program per token scatters its keys/values into their paged slot (slot -1:
padding, left untouched). Same semantics as ``kernels.attention_ref.write_kv_ref``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])  # kernels/launch.py
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cp, stride_ch,  # k_cache and v_cache share strides (checked on the host)
    num_kv_heads, head_dim, page_size,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding row: must leave the cache untouched
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    dst = (slot // page_size) * stride_cb + (slot % page_size) * stride_cp + h * stride_ch + d
    k = tl.load(key_ptr + tok * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    # The kernel indexes the last dim with unit stride and both caches with one set of strides.
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads, head_dim, k_cache.shape[1],
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )
