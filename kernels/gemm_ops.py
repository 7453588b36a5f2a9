"""The skinny-GEMM ops (batch-1 decode / verify), registered with torch.library like
``kernels.ops``' attention ops: one launch for a linear (+ a fused RMSNorm prologue, + a residual,
or gate_up's SiLU-and-mul, or qkv's rope + KV write). The Triton kernels run on CUDA for
M <= MAX_M rows (WIDE_MAX_M in ``kernels.dispatch.skinny_wide_scope``); prefill-sized M on the
GPU takes cuBLAS and our small kernels around it, the CPU the exact unfused PyTorch ops
(``kernels.skinny_gemm_ref``)."""
from __future__ import annotations

import torch

from kernels.dispatch import attention_triton, skinny_max_rows, use_triton
from kernels.skinny_gemm_ref import (gated_linear_ref, linear_ref, qkv_rope_write_kv_ref,
                                     rmsnorm_linear_ref)


def _skinny(x: torch.Tensor) -> bool:
    return use_triton(x) and x.shape[0] <= skinny_max_rows()


@torch.library.custom_op("compiled_spec::skinny_linear", mutates_args=())
def skinny_linear(x: torch.Tensor,  # [M, K]
                  weight: torch.Tensor,  # [N, K]
                  residual: torch.Tensor | None = None,  # [M, N]
                  ) -> torch.Tensor:  # [M, N]: residual + x @ weight^T
    if _skinny(x):
        from kernels.skinny_gemm_triton import skinny_gemm_triton

        return skinny_gemm_triton(x, weight, residual=residual)
    if residual is not None and x.is_cuda:  # prefill-sized M: the add in cuBLAS's epilogue
        # (one launch, as the unfused graph's add is fused into the next norm; one rounding
        # of product + residual instead of two)
        return torch.addmm(residual, x, weight.t())
    return linear_ref(x, weight, residual)


@torch.library.custom_op("compiled_spec::rmsnorm_linear", mutates_args=())
def rmsnorm_linear(x: torch.Tensor,  # [M, K]
                   norm_weight: torch.Tensor,  # [K]
                   eps: float,
                   weight: torch.Tensor,  # [N, K]
                   residual: torch.Tensor | None = None,  # [M, N]
                   ) -> torch.Tensor:  # [M, N]: residual + rmsnorm(x) @ weight^T
    if _skinny(x):
        from kernels.skinny_gemm_triton import skinny_gemm_triton

        return skinny_gemm_triton(x, weight, norm_weight=norm_weight, eps=eps,
                                  residual=residual)
    return rmsnorm_linear_ref(x, norm_weight, eps, weight, residual)


@torch.library.custom_op("compiled_spec::gated_linear", mutates_args=())
def gated_linear(x: torch.Tensor,  # [M, K]
                 norm_weight: torch.Tensor | None,  # [K]: RMSNorm prologue, or None
                 eps: float,
                 weight: torch.Tensor,  # [2N, K] = [gate; up] (the fused gate_up projection)
                 ) -> torch.Tensor:  # [M, N]: silu(gate) * up of rmsnorm(x) @ weight^T
    """The gated MLP's first half (RMSNorm, gate_up, SiLU-and-mul) as one op: one launch on
    the GPU at decode sizes."""
    if _skinny(x):
        from kernels.skinny_gemm_triton import skinny_gemm_triton

        return skinny_gemm_triton(x, weight, norm_weight=norm_weight, eps=eps, gated=True)
    if x.is_cuda:  # prefill-sized M: cuBLAS, then SiLU-and-mul in one launch
        from kernels.skinny_gemm_triton import silu_mul_triton

        return gated_linear_ref(x, norm_weight, eps, weight, silu_mul=silu_mul_triton)
    return gated_linear_ref(x, norm_weight, eps, weight)


@torch.library.custom_op("compiled_spec::qkv_rope_write_kv", mutates_args=("k_cache", "v_cache"))
def qkv_rope_write_kv(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [(heads + 2 kv heads) * head_dim, K]: the fused qkv projection
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [M] int64; -1 rows are not written
    cos: torch.Tensor,  # [M, head_dim]
    sin: torch.Tensor,  # [M, head_dim]
    num_heads: int,
    norm_weight: torch.Tensor | None,  # [K]: the layer's input RMSNorm, or None
    eps: float,
) -> torch.Tensor:  # [M, num_heads, head_dim] the roped queries
    """``rope_write_kv`` with its qkv projection (and the norm before it) inside: one launch on
    the GPU at decode sizes (``kernels.qkv_rope_triton``). k_cache, v_cache and slot_mapping
    sit where ``write_kv`` has them, so the passes that bind a layer's metadata read all alike."""
    half = k_cache.shape[-1] // 2
    if _skinny(x) and half >= 16 and half & (half - 1) == 0:  # tl.dot tiles of a half head
        from kernels.qkv_rope_triton import qkv_rope_write_kv_triton

        return qkv_rope_write_kv_triton(x, weight, k_cache, v_cache, slot_mapping, cos, sin,
                                        num_heads, norm_weight, eps)
    kernel = {}
    if attention_triton(x):  # prefill-sized M on the GPU: cuBLAS, then the rope + KV kernel
        from kernels.rope_kv_triton import rope_write_kv_triton

        kernel = {"rope_write_kv": rope_write_kv_triton}
    return qkv_rope_write_kv_ref(x, weight, k_cache, v_cache, slot_mapping, cos, sin, num_heads,
                                 norm_weight, eps, **kernel)


@qkv_rope_write_kv.register_fake
def _(x, weight, k_cache, v_cache, slot_mapping, cos, sin, num_heads, norm_weight, eps):
    return x.new_empty(x.shape[0], num_heads, k_cache.shape[-1])


def _gemm_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


@skinny_linear.register_fake
def _(x, weight, residual=None) -> torch.Tensor:
    return _gemm_out(x, weight)


@rmsnorm_linear.register_fake
def _(x, norm_weight, eps, weight, residual=None) -> torch.Tensor:
    return _gemm_out(x, weight)


@gated_linear.register_fake
def _(x, norm_weight, eps, weight) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0] // 2)
