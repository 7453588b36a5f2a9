"""Triton rope + KV write in one kernel: one program per token ropes its query and key heads,
writes the roped keys and the values into their paged slot (slot -1: padding, cache untouched)
and writes the roped queries out for the attention kernel.

Why one kernel: with the rope in Inductor's code and the write as its own op, every layer of
every decode, verify and draft step ran two launches for what is one pass over q, k and v (H200,
SmolLM2 chain verify: rope 1.2 us + KV write 1.4 us per layer, x30 layers). The math is the
Inductor kernel's (fp32 inside, one rounding per output) on the reference's formula
(``kernels.attention_ref.rope_write_kv_ref``): x * cos + rotate_half(x) * sin, neox halves.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])  # kernels/launch.py
def _rope_write_kv_kernel(
    qk_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qkt, stride_qkh, stride_vt, stride_vh, stride_ct, stride_st, stride_ot, stride_oh,
    stride_cb, stride_cp, stride_ch,  # k_cache and v_cache share strides (checked on the host)
    num_heads, num_kv_heads, page_size,
    HALF: tl.constexpr, HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]  # [1, HALF] the first half's lanes; + HALF the second's
    c_lo = tl.load(cos_ptr + tok * stride_ct + d).to(tl.float32)
    c_hi = tl.load(cos_ptr + tok * stride_ct + HALF + d).to(tl.float32)
    s_lo = tl.load(sin_ptr + tok * stride_st + d).to(tl.float32)
    s_hi = tl.load(sin_ptr + tok * stride_st + HALF + d).to(tl.float32)
    # Queries: heads 0 .. num_heads-1 of qk, always written (padding rows' are never read).
    hq = tl.arange(0, HEADS_PAD)[:, None]
    mq = hq < num_heads
    src = qk_ptr + tok * stride_qkt + hq * stride_qkh + d
    lo = tl.load(src, mask=mq).to(tl.float32)
    hi = tl.load(src + HALF, mask=mq).to(tl.float32)
    dst = q_out_ptr + tok * stride_ot + hq * stride_oh + d
    tl.store(dst, (lo * c_lo - hi * s_lo).to(q_out_ptr.dtype.element_ty), mask=mq)
    tl.store(dst + HALF, (hi * c_hi + lo * s_hi).to(q_out_ptr.dtype.element_ty), mask=mq)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:  # padding row: must leave the cache untouched
        return
    # Keys: heads num_heads .. num_heads + num_kv_heads - 1 of qk; values as they are.
    hk = tl.arange(0, KV_PAD)[:, None]
    mk = hk < num_kv_heads
    src = qk_ptr + tok * stride_qkt + (num_heads + hk) * stride_qkh + d
    lo = tl.load(src, mask=mk).to(tl.float32)
    hi = tl.load(src + HALF, mask=mk).to(tl.float32)
    at = (slot // page_size) * stride_cb + (slot % page_size) * stride_cp + hk * stride_ch + d
    ty = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + at, (lo * c_lo - hi * s_lo).to(ty), mask=mk)
    tl.store(k_cache_ptr + at + HALF, (hi * c_hi + lo * s_hi).to(ty), mask=mk)
    vsrc = v_ptr + tok * stride_vt + hk * stride_vh + d
    tl.store(v_cache_ptr + at, tl.load(vsrc, mask=mk).to(ty), mask=mk)
    tl.store(v_cache_ptr + at + HALF, tl.load(vsrc + HALF, mask=mk).to(ty), mask=mk)


def rope_write_kv_triton(
    qk: torch.Tensor,  # [num_tokens, num_heads + num_kv_heads, head_dim] (a strided view is fine)
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    cos: torch.Tensor,  # [num_tokens, head_dim]
    sin: torch.Tensor,  # [num_tokens, head_dim]
    num_heads: int,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] the roped queries
    num_tokens, _, head_dim = qk.shape
    num_kv_heads = value.shape[1]
    q_out = qk.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return q_out
    half = head_dim // 2
    # The kernel's lanes cover each half exactly: head dims whose half is a power of two
    # (64, 128, 256: every model we load); the last dims are unit-stride.
    assert half == triton.next_power_of_2(half), f"head_dim {head_dim}: half not a power of 2"
    assert qk.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    _rope_write_kv_kernel[(num_tokens,)](
        qk, value, cos, sin, q_out, k_cache, v_cache, slot_mapping,
        qk.stride(0), qk.stride(1), value.stride(0), value.stride(1), cos.stride(0),
        sin.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, num_kv_heads, k_cache.shape[1],
        HALF=half, HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_PAD=triton.next_power_of_2(num_kv_heads),
    )
    return q_out


@triton.jit
def _rope_table_kernel(pos_ptr, cos_cache_ptr, sin_cache_ptr, cos_ptr, sin_ptr, num_tokens,
                       max_positions, stride_cache, HEAD_DIM: tl.constexpr,
                       DIM_PAD: tl.constexpr, BLOCK_T: tl.constexpr, TO_BF16: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    cols = tl.arange(0, DIM_PAD)[None, :]  # [1, DIM_PAD]
    rmask = rows < num_tokens
    mask = rmask[:, None] & (cols < HEAD_DIM)
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0).to(tl.int64)
    # A padding row's position may be anything: never read outside the tables for it.
    pos = tl.minimum(tl.maximum(pos, 0), max_positions - 1)
    src = pos[:, None] * stride_cache + cols
    dst = rows[:, None].to(tl.int64) * HEAD_DIM + cols
    c = tl.load(cos_cache_ptr + src, mask=mask)
    s = tl.load(sin_cache_ptr + src, mask=mask)
    if TO_BF16:  # round to nearest even by hand: the interpreter's cast truncates
        c, s = _bf16_rne(c), _bf16_rne(s)
    tl.store(cos_ptr + dst, c.to(cos_ptr.dtype.element_ty), mask=mask)
    tl.store(sin_ptr + dst, s.to(sin_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bf16_rne(x):
    """fp32 -> bf16 rounded to nearest even, as torch's cast does (finite inputs)."""
    b = x.to(tl.int32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.to(tl.int16).to(tl.bfloat16, bitcast=True)


def rope_table_triton(
    positions: torch.Tensor,  # [num_tokens] int
    cos_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    sin_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, head_dim] each, in dtype
    """The rows of both tables at ``positions``, cast to ``dtype``: one launch for what the
    gather and the casts of ``kernels.attention_ref.rope_table_ref`` do."""
    num_tokens, head_dim = positions.shape[0], cos_cache.shape[1]
    assert cos_cache.stride() == sin_cache.stride() and cos_cache.stride(1) == 1
    cos = torch.empty((num_tokens, head_dim), dtype=dtype, device=positions.device)
    sin = torch.empty((num_tokens, head_dim), dtype=dtype, device=positions.device)
    if num_tokens:
        block_t = 16
        _rope_table_kernel[(triton.cdiv(num_tokens, block_t),)](
            positions, cos_cache, sin_cache, cos, sin, num_tokens, cos_cache.shape[0],
            cos_cache.stride(0),
            HEAD_DIM=head_dim, DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_T=block_t,
            TO_BF16=dtype == torch.bfloat16)
    return cos, sin
