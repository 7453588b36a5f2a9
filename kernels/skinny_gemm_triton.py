"""Skinny GEMM y[M, N] = A[M, K] @ W[N, K]^T for M <= 64 rows (batch-1 decode / verify), with
optional fused prologues and a residual epilogue. Same numerics as ``kernels.skinny_gemm_ref``
up to fp32 summation order.

Layout of the work: one program per BLOCK_N columns (and per K split), holding all M rows, so
each weight byte is read once and a 576-wide layer GEMM spreads over 36+ CTAs instead of cuBLAS's
9 (``kernels.gemm_config``). The A operand is built in registers from x:
  PROLOGUE 0: A = x
  PROLOGUE 1: A = rmsnorm(x) * w_norm; every program recomputes its rows' rms over K first (K is
             small, x is a few KB and stays in L2), which removes the separate norm kernel
  PROLOGUE 2: x is [M, 2K] = [gate | up], A = silu(gate) * up (the gated MLP's down_proj input)
Each step rounds to x's dtype where the PyTorch modules do (the normalised row before the norm
weight, silu before the product), so bf16 results match the unfused model closely.
Epilogue: + residual[M, N] after rounding the product, as ``residual + linear(...)`` does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# fp32 stays fp32 (F.linear uses no TF32 by default); bf16 is upcast only under the CPU
# interpreter, which runs tl.dot on bf16 tiles as matmuls of their raw bits.
from kernels.attention_triton import _dot_in_fp32
from kernels.gemm_config import GemmConfig, gemm_config

PRO_NONE, PRO_RMSNORM, PRO_SILU_MUL = 0, 1, 2


@triton.jit
def _load_a(x_ptr, nw_ptr, offs_m, offs_k, M, K, stride_xm, rstd, PROLOGUE: tl.constexpr):
    """The A tile [BLOCK_M, BLOCK_K] in x's dtype; zero outside M and K."""
    mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    x = tl.load(ptrs, mask=mask, other=0.0)
    # Products of two x-dtype values are written as fp32 math rounded back to the dtype: what
    # the GPU does for bf16 anyway, and the CPU interpreter has no bf16 arithmetic of its own.
    if PROLOGUE == 1:
        nw = tl.load(nw_ptr + offs_k, mask=offs_k < K, other=0.0)
        h = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        x = (h.to(tl.float32) * nw.to(tl.float32)[None, :]).to(x.dtype)
    elif PROLOGUE == 2:
        up = tl.load(ptrs + K, mask=mask, other=0.0)  # the up half sits K columns later
        g = x.to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(x.dtype)
        x = (s.to(tl.float32) * up.to(tl.float32)).to(x.dtype)
    return x


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, res_ptr, part_ptr,
                        M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, eps,
                        PROLOGUE: tl.constexpr, HAS_RES: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1:  # the row's rms needs all of K, whichever K split this program owns
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
            xr = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            ss += tl.sum(xr * xr, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    # This program's share of K: whole BLOCK_K steps, so splits never overlap.
    steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = pid_k * steps * BLOCK_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(0, steps):
        offs_k = k_begin + i * BLOCK_K + tl.arange(0, BLOCK_K)
        a = _load_a(x_ptr, nw_ptr, offs_m, offs_k, M, K, stride_xm, rstd, PROLOGUE)
        # W read as its transpose [BLOCK_K, BLOCK_N]; each column is a contiguous weight row.
        w_mask = (offs_k[:, None] < K) & (offs_n[None, :] < N)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0.0)
        if USE_DOT:
            if DOT_FP32:  # fp32 products, not TF32 (see _dot_in_fp32 for the bf16 case)
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        else:  # [BLOCK_M, BLOCK_K, 1] * [1, BLOCK_K, BLOCK_N] summed over K, on CUDA cores
            acc += tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        out = acc.to(y_ptr.dtype.element_ty)
        if HAS_RES:  # round the product first, then add (as residual + linear(...) does)
            res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :],
                          mask=out_mask, other=0.0)
            out = (out.to(tl.float32) + res.to(tl.float32)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], out, mask=out_mask)
    else:  # fp32 partials [SPLIT_K, M, N], summed by _split_k_reduce
        tl.store(part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], acc,
                 mask=out_mask)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce(part_ptr, y_ptr, res_ptr, M, N, stride_ym, stride_rm,
                    HAS_RES: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    m = offs // N
    n = offs % N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    out = acc.to(y_ptr.dtype.element_ty)
    if HAS_RES:
        res = tl.load(res_ptr + m * stride_rm + n, mask=mask, other=0.0)
        out = (out.to(tl.float32) + res.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + m * stride_ym + n, out, mask=mask)


def skinny_gemm_triton(x: torch.Tensor,  # [M, K] ([M, 2K] with silu_mul)
                       weight: torch.Tensor,  # [N, K]
                       norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm prologue
                       eps: float = 0.0,
                       silu_mul: bool = False,
                       residual: torch.Tensor | None = None,  # [M, N]
                       config: GemmConfig | None = None,
                       ) -> torch.Tensor:  # [M, N] in x's dtype
    m = x.shape[0]
    n, k = weight.shape
    if norm_weight is not None and silu_mul:
        raise ValueError("skinny GEMM: one prologue at a time (rmsnorm or silu_mul)")
    if x.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"skinny GEMM: x {tuple(x.shape)} does not fit weight {(n, k)}"
                         + (" (silu_mul wants [M, 2K])" if silu_mul else ""))
    others = [t for t in (weight, norm_weight, residual) if t is not None]
    if any(t.dtype != x.dtype for t in others):  # one dtype throughout, as in the model
        raise ValueError("skinny GEMM: x, weight, norm weight and residual share one dtype, "
                         f"got {[x.dtype] + [t.dtype for t in others]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return y
    if residual is not None:
        if tuple(residual.shape) != (m, n):
            raise ValueError(f"skinny GEMM: residual {tuple(residual.shape)} is not {(m, n)}")
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    cfg = config or gemm_config(m, n, k)
    if cfg.block_m < m:
        raise ValueError(f"skinny GEMM: config {cfg.name} holds fewer than M={m} rows")
    prologue = PRO_RMSNORM if norm_weight is not None else PRO_SILU_MUL if silu_mul else PRO_NONE
    # fp32 partials only when K is split; otherwise the pointer is never read
    part = (torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
            if cfg.split_k > 1 else y)
    res = residual if residual is not None else y
    nw = norm_weight if norm_weight is not None else y
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k)
    _skinny_gemm_kernel[grid](
        x, weight, y, nw, res, part, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        res.stride(0), float(eps), PROLOGUE=prologue, HAS_RES=residual is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
        USE_DOT=cfg.use_dot, DOT_FP32=_dot_in_fp32(x.dtype), num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        block = 1024
        _split_k_reduce[(triton.cdiv(m * n, block),)](
            part, y, res, m, n, y.stride(0), res.stride(0), HAS_RES=residual is not None,
            SPLIT_K=cfg.split_k, BLOCK=block)
    return y
