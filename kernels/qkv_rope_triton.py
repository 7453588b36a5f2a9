"""The attention's input side at decode sizes in one launch: [RMSNorm ->] the fused qkv GEMM ->
rope of q and k -> (roped k, v) into the paged cache, roped q out for the attention kernel.

It replaces three kernels per layer (Inductor's norm, the qkv GEMM, ``kernels.rope_kv_triton``)
with the skinny GEMM's K loop (``kernels.skinny_gemm_triton._k_loop``) and a rope epilogue. A
program owns BLOCK_N lanes of one head's first half and the same lanes of its second half (two
accumulators, the neox pairs d and d + head_dim / 2), so it can rope without another program's
columns; which head it owns (query, key or value) decides where its tile goes. Rounding follows
the unfused path: the GEMM's output rounded to the dtype, the rope in fp32 rounded once (the
rope kernel's and Inductor's math). Rows with slot -1 (padding) leave the cache untouched.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from kernels.attention_triton import _dot_in_fp32
from kernels.dispatch import late_trigger, pdl_launch
from kernels.gemm_config import GemmConfig, gemm_config
from kernels.skinny_gemm_triton import _k_loop


@triton.jit(do_not_specialize=["M"], do_not_specialize_on_alignment=["slot_ptr"])
def _qkv_rope_kv_kernel(
    x_ptr, w_ptr, nw_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    M, K, stride_xm, stride_wn, stride_ct, stride_st, stride_qt, stride_qh,
    stride_cb, stride_cp, stride_ch,  # k_cache and v_cache share strides (checked on the host)
    num_heads, num_kv_heads, page_size, eps,
    HALF: tl.constexpr, NORM: tl.constexpr, NW_IN_A: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr,
    GDC: tl.constexpr, LATE: tl.constexpr,
):
    pid = tl.program_id(0)
    head = pid // (HALF // BLOCK_N)  # 0 .. heads + 2 kv heads - 1, in the qkv weight's order
    lane = (pid % (HALF // BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] in a half
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # this tile's rows
    m_ok = offs_m < M
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    lo, hi, ss = _k_loop(x_ptr, w_ptr, nw_ptr, offs_m, head * 2 * HALF + lane, lane < HALF, HALF,
                         M, K, stride_xm, stride_wn, 0, tl.cdiv(K, BLOCK_K), ss, NORM, NW_IN_A,
                         True, 1,
                         BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, DOT_FP32, GDC, LATE)
    if LATE:  # the attention after us launches now (kernels.dispatch.late_trigger)
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        rstd = tl.rsqrt(ss / K + eps)[:, None]
        lo = lo * rstd
        hi = hi * rstd
    ty = q_ptr.dtype.element_ty
    lo = lo.to(ty).to(tl.float32)  # [BLOCK_M, BLOCK_N], rounded as the linear's output is
    hi = hi.to(ty).to(tl.float32)
    mask = m_ok[:, None]
    if head < num_heads + num_kv_heads:  # q and k heads are roped, v heads are not
        row = offs_m[:, None]
        c_lo = tl.load(cos_ptr + row * stride_ct + lane[None, :], mask=mask, other=0.0)
        c_hi = tl.load(cos_ptr + row * stride_ct + HALF + lane[None, :], mask=mask, other=0.0)
        s_lo = tl.load(sin_ptr + row * stride_st + lane[None, :], mask=mask, other=0.0)
        s_hi = tl.load(sin_ptr + row * stride_st + HALF + lane[None, :], mask=mask, other=0.0)
        new_lo = lo * c_lo.to(tl.float32) - hi * s_lo.to(tl.float32)
        hi = hi * c_hi.to(tl.float32) + lo * s_hi.to(tl.float32)
        lo = new_lo
    if head < num_heads:
        dst = q_ptr + offs_m[:, None] * stride_qt + head * stride_qh + lane[None, :]
        tl.store(dst, lo.to(ty), mask=mask)
        tl.store(dst + HALF, hi.to(ty), mask=mask)
    else:
        slot = tl.load(slot_ptr + offs_m, mask=m_ok, other=-1).to(tl.int64)  # [BLOCK_M]
        ok = (m_ok & (slot >= 0))[:, None]
        safe = tl.where(slot >= 0, slot, 0)
        kv = head - num_heads
        is_v = kv >= num_kv_heads
        kv = tl.where(is_v, kv - num_kv_heads, kv)
        at = ((safe // page_size) * stride_cb + (safe % page_size) * stride_cp)[:, None] \
            + kv * stride_ch + lane[None, :]
        cty = k_cache_ptr.dtype.element_ty
        if is_v:
            tl.store(v_cache_ptr + at, lo.to(cty), mask=ok)
            tl.store(v_cache_ptr + at + HALF, hi.to(cty), mask=ok)
        else:
            tl.store(k_cache_ptr + at, lo.to(cty), mask=ok)
            tl.store(k_cache_ptr + at + HALF, hi.to(cty), mask=ok)


def qkv_config(m: int, n: int, k: int, half: int) -> GemmConfig:
    """The skinny GEMM's pick for this shape with N tiles that fit a half head."""
    cfg = gemm_config(m, n, k)
    return replace(cfg, block_n=min(cfg.block_n, half), split_k=1)


def qkv_rope_write_kv_triton(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [(heads + 2 kv heads) * head_dim, K]: q rows, then k, then v
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [M] int64, -1 = skip
    cos: torch.Tensor,  # [M, head_dim]
    sin: torch.Tensor,  # [M, head_dim]
    num_heads: int,
    norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm prologue
    eps: float = 0.0,
    config: GemmConfig | None = None,
    norm_in_weight: bool = False,  # weight's columns scaled by the norm weight already
) -> torch.Tensor:  # [M, num_heads, head_dim] the roped queries
    m, k = x.shape
    head_dim, num_kv_heads = k_cache.shape[-1], k_cache.shape[-2]
    half = head_dim // 2
    if weight.shape != ((num_heads + 2 * num_kv_heads) * head_dim, k):
        raise ValueError(f"qkv rope: weight {tuple(weight.shape)} is not "
                         f"({num_heads} + 2 x {num_kv_heads}) heads x {head_dim} by {k}")
    if any(t.dtype != x.dtype for t in (weight, k_cache) + ((norm_weight,) if norm_weight
                                                             is not None else ())):
        raise ValueError("qkv rope: x, weight, norm weight and the cache share one dtype")
    q = x.new_empty(m, num_heads, head_dim)
    if m == 0:
        return q
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1
    cfg = config or qkv_config(m, weight.shape[0], k, half)
    if half % cfg.block_n or cfg.split_k != 1:
        raise ValueError(f"qkv rope: config {cfg.name} does not fit half head {half}")
    grid = ((num_heads + 2 * num_kv_heads) * (half // cfg.block_n), triton.cdiv(m, cfg.block_m))
    _qkv_rope_kv_kernel[grid](
        x, weight, norm_weight if norm_weight is not None else x, cos, sin, q, k_cache, v_cache,
        slot_mapping, m, k, x.stride(0), weight.stride(0), cos.stride(0), sin.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, num_kv_heads, k_cache.shape[1], float(eps),
        HALF=half, NORM=norm_weight is not None or norm_in_weight,
        NW_IN_A=norm_weight is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, USE_DOT=cfg.use_dot, DOT_FP32=_dot_in_fp32(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, LATE=late_trigger(x), **pdl_launch(x))
    return q
