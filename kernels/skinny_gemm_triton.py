"""Skinny GEMM y[M, N] = A[M, K] @ W[N, K]^T for few rows (decode / verify: M <= 64 in one
tile, up to 256 in tiles of 64 with the wide option, ``kernels.gemm_config``), with
an optional RMSNorm prologue, a gated (SiLU-and-mul) or residual epilogue. Same numerics as
``kernels.skinny_gemm_ref`` up to fp32 summation order and where the norm's rounding falls.

Layout of the work: one program per BLOCK_N columns (and per K split), holding all M rows, so
each weight byte is read once and a 576-wide layer GEMM spreads over 36+ CTAs instead of cuBLAS's
9 (``kernels.gemm_config``). A decoder layer at decode sizes is then 4 launches around attention
instead of 4 GEMMs plus 2 norm kernels and a SiLU-and-mul kernel:
  NORM: A = x * w_norm and the product is scaled by each row's rstd = rsqrt(mean(x^2) + eps) at
        the end: rstd is one number per row, so it factors out of the dot product, and the
        row's sum of squares accumulates in the same K loop that streams x (no pass over x
        before the GEMM: the sixteenth session's prologue did one and lost to the separate norm
        kernel, 5.73 vs 4.68 us on the H200). With split-K a program sees only its share of K,
        so there the sums come from a pass over x first.
  GATED: W is [2N, K] = [gate; up] (the fused gate_up projection), every program holds the gate
        and up tiles of the same N columns, and the epilogue writes silu(gate) * up, rounding
        where the model does (the linear's output, silu's, the product's). Not with split-K.
  HAS_RES: + residual[M, N] after rounding the product, as ``residual + linear(...)`` does.
The norm's rounding differs from the model's: the model rounds x * rstd to x's dtype and then
the product with w_norm, here x * w_norm is rounded once and rstd scales the fp32 sum (equal
up to a bf16 ulp; exact math in fp32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# fp32 stays fp32 (F.linear uses no TF32 by default); bf16 is upcast only under the CPU
# interpreter, which runs tl.dot on bf16 tiles as matmuls of their raw bits.
from kernels.attention_triton import _dot_in_fp32
from kernels.dispatch import late_trigger, pdl_launch
from kernels.gemm_config import GemmConfig, gemm_config


@triton.jit
def _mma(a, w, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] @ w [BLOCK_K, BLOCK_N] in fp32."""
    if USE_DOT:
        if DOT_FP32:  # fp32 products, not TF32 (see _dot_in_fp32 for the bf16 case)
            return tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        return tl.dot(a, w)
    # [BLOCK_M, BLOCK_K, 1] * [1, BLOCK_K, BLOCK_N] summed over K, on CUDA cores
    return tl.sum(a.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _silu_mul(g, up, ty: tl.constexpr):
    """silu(gate) * up from fp32 values already rounded to ``ty``: silu rounded, then the
    product, as the model's two ops round (the gated epilogue and the SiLU-and-mul kernel)."""
    s = (g / (1.0 + tl.exp(-g))).to(ty).to(tl.float32)
    return (s * up).to(ty)


@triton.jit
def _a_tile(x_ptr, nw_ptr, offs_m, offs_k, m_ok, k_ok, stride_xm, sq, NORM: tl.constexpr,
            NW_IN_A: tl.constexpr, SPLIT_K: tl.constexpr):
    """One K step's A tile [BLOCK_M, BLOCK_K] (x, or x * w_norm) and the squares' sums."""
    a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    if NORM:
        xf = a.to(tl.float32)
        if SPLIT_K == 1:  # else the caller summed all of K before
            sq += xf * xf
        if NW_IN_A:
            nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0)
            a = (xf * nw.to(tl.float32)[None, :]).to(a.dtype)
    return a, sq


@triton.jit
def _w_tile(w_ptr, offs_n, n_ok, offs_k, k_ok, stride_wn):
    """W read as its transpose [BLOCK_K, BLOCK_N]; each column is a contiguous weight row."""
    return tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                   mask=k_ok[:, None] & n_ok[None, :], other=0.0)


@triton.jit
def _k_loop(x_ptr, w_ptr, nw_ptr, offs_m, offs_n, n_ok, pair_rows, M, K, stride_xm, stride_wn,
            k_begin, steps, ss, NORM: tl.constexpr, NW_IN_A: tl.constexpr,
            PAIRED: tl.constexpr, SPLIT_K: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
            USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, GDC: tl.constexpr,
            LATE: tl.constexpr = False):
    """This program's K steps: (acc [BLOCK_M, BLOCK_N] over W rows offs_n, acc2 over rows
    offs_n + pair_rows when PAIRED (gate / up, a head's two rope halves), ss + each row's sum
    of x^2 with NORM and one K split). With NORM the caller applies rstd; the norm weight
    scales A here (NW_IN_A) or was folded into W's columns beforehand. The squares add up
    lane by lane and are summed across lanes once after the loop: a cross-lane reduction per
    K step sat on the loop's critical path (the first form, 6.4 us vs 3.3 for the GEMM alone
    at M = 1 on the H200).
    GDC (1: launched with programmatic dependent launch): the first K step's weights, which no
    kernel writes, are loaded while the kernel before is still running; then the program waits
    for it (griddepcontrol.wait: its outputs, x among them, are visible after) and lets the
    kernel after it launch, which does the same. Nothing is read from or written to memory
    another kernel writes before the wait. LATE: the caller lets the kernel after it launch
    once its K loop is done, not here (``kernels.dispatch.late_trigger``)."""
    m_ok = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    if GDC:
        offs_k = k_begin + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = _w_tile(w_ptr, offs_n, n_ok, offs_k, k_ok, stride_wn)
        w2 = w
        if PAIRED:
            w2 = _w_tile(w_ptr, offs_n + pair_rows, n_ok, offs_k, k_ok, stride_wn)
        tl.extra.cuda.gdc_wait()
        if not LATE:
            tl.extra.cuda.gdc_launch_dependents()
        a, sq = _a_tile(x_ptr, nw_ptr, offs_m, offs_k, m_ok, k_ok, stride_xm, sq, NORM,
                        NW_IN_A, SPLIT_K)
        acc += _mma(a, w, USE_DOT, DOT_FP32)
        if PAIRED:
            acc2 += _mma(a, w2, USE_DOT, DOT_FP32)
    for i in range(GDC, steps):  # GDC: step 0 done above
        offs_k = k_begin + i * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a, sq = _a_tile(x_ptr, nw_ptr, offs_m, offs_k, m_ok, k_ok, stride_xm, sq, NORM,
                        NW_IN_A, SPLIT_K)
        acc += _mma(a, _w_tile(w_ptr, offs_n, n_ok, offs_k, k_ok, stride_wn), USE_DOT,
                    DOT_FP32)
        if PAIRED:
            acc2 += _mma(a, _w_tile(w_ptr, offs_n + pair_rows, n_ok, offs_k, k_ok, stride_wn),
                         USE_DOT, DOT_FP32)
    if NORM and SPLIT_K == 1:
        ss += tl.sum(sq, axis=1)
    return acc, acc2, ss


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(x_ptr, w_ptr, y_ptr, nw_ptr, res_ptr, part_ptr,
                        M, N, K, stride_xm, stride_wn, stride_ym, stride_rm, eps,
                        NORM: tl.constexpr, NW_IN_A: tl.constexpr, GATED: tl.constexpr,
                        HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, USE_DOT: tl.constexpr,
                        DOT_FP32: tl.constexpr, GDC: tl.constexpr, LATE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # this tile's rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)  # per row: sum of x^2 over all of K (NORM)
    if NORM and SPLIT_K > 1:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xr = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                         mask=m_ok[:, None] & (offs_k[None, :] < K), other=0.0).to(tl.float32)
            ss += tl.sum(xr * xr, axis=1)
    # This program's share of K: whole BLOCK_K steps, so splits never overlap.
    steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    # GATED: the up rows sit N rows after the gate rows
    acc, acc_up, ss = _k_loop(x_ptr, w_ptr, nw_ptr, offs_m, offs_n, offs_n < N, N, M, K,
                              stride_xm, stride_wn, pid_k * steps * BLOCK_K, steps, ss,
                              NORM, NW_IN_A, GATED, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K,
                              USE_DOT, DOT_FP32, GDC, LATE)
    if LATE:  # the kernel after us launches now (kernels.dispatch.late_trigger)
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:
        rstd = tl.rsqrt(ss / K + eps)  # [BLOCK_M]; padding rows: finite, times a zero sum
        acc = acc * rstd[:, None]
        acc_up = acc_up * rstd[:, None]
    out_mask = m_ok[:, None] & (offs_n[None, :] < N)
    if SPLIT_K == 1:
        out = acc.to(y_ptr.dtype.element_ty)
        if GATED:
            ty = y_ptr.dtype.element_ty
            out = _silu_mul(out.to(tl.float32), acc_up.to(ty).to(tl.float32), ty)
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


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(gu_ptr, y_ptr, M, N, stride_gm, stride_ym, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(gu_ptr + row * stride_gm + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gm + N + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + offs, _silu_mul(g, up, y_ptr.dtype.element_ty), mask=ok)


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:  # [M, 2N] -> [M, N]
    """silu(gate) * up of a [gate | up] row, rounded as the model's two ops are, in one launch
    (PyTorch's chunk / silu / mul is two kernels): the gated op's path for prefill-sized M."""
    m, n2 = gate_up.shape
    n = n2 // 2
    y = gate_up.new_empty(m, n)
    if m == 0:
        return y
    gate_up = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_kernel[(m, triton.cdiv(n, block))](gate_up, y, m, n, gate_up.stride(0),
                                                   y.stride(0), BLOCK=block)
    return y


def skinny_gemm_triton(x: torch.Tensor,  # [M, K]
                       weight: torch.Tensor,  # [N, K] ([2N, K] = [gate; up] when gated)
                       norm_weight: torch.Tensor | None = None,  # [K]: RMSNorm prologue
                       eps: float = 0.0,
                       gated: bool = False,
                       residual: torch.Tensor | None = None,  # [M, N]
                       config: GemmConfig | None = None,
                       norm_in_weight: bool = False,
                       ) -> torch.Tensor:  # [M, N] in x's dtype
    """``norm_in_weight``: weight's columns are already scaled by the norm weight (RMSNorm
    without its weight is applied; norm_weight must be None)."""
    m, k = x.shape
    if norm_in_weight and norm_weight is not None:
        raise ValueError("skinny GEMM: norm_in_weight means the norm weight is in W already")
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    if weight.shape[1] != k or (gated and weight.shape[0] % 2):
        raise ValueError(f"skinny GEMM: x {tuple(x.shape)} does not fit weight "
                         f"{tuple(weight.shape)}" + (" (gated wants [2N, K])" if gated else ""))
    if gated and residual is not None:
        raise ValueError("skinny GEMM: a gated output takes no residual")
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
    if gated and cfg.split_k > 1:
        raise ValueError(f"skinny GEMM: config {cfg.name} splits K, which a gated output "
                         "cannot (its epilogue needs the whole sums)")
    # fp32 partials only when K is split; otherwise the pointer is never read
    part = (torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
            if cfg.split_k > 1 else y)
    res = residual if residual is not None else y
    nw = norm_weight if norm_weight is not None else y
    grid = (triton.cdiv(n, cfg.block_n), cfg.split_k, triton.cdiv(m, cfg.block_m))  # M tiles
    _skinny_gemm_kernel[grid](
        x, weight, y, nw, res, part, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        res.stride(0), float(eps), NORM=norm_weight is not None or norm_in_weight,
        NW_IN_A=norm_weight is not None, GATED=gated,
        HAS_RES=residual is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, USE_DOT=cfg.use_dot,
        DOT_FP32=_dot_in_fp32(x.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        LATE=cfg.split_k == 1 and late_trigger(x), **pdl_launch(x, cfg.split_k == 1))
    if cfg.split_k > 1:
        block = 1024
        _split_k_reduce[(triton.cdiv(m * n, block),)](
            part, y, res, m, n, y.stride(0), res.stride(0), HAS_RES=residual is not None,
            SPLIT_K=cfg.split_k, BLOCK=block)
    return y
