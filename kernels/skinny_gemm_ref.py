"""Exact PyTorch references of the fused skinny-GEMM ops: the very ops the unfused model runs
(``compiled_spec.models.layers``: RMSNorm, GatedMLP; the decoder's ``hidden + ...``), so the CPU
path of a rewritten graph computes bit for bit what the original graph did."""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from kernels.attention_ref import rope_write_kv_ref


def rms_norm_ref(x: torch.Tensor,  # [M, K]
                 weight: torch.Tensor,  # [K]
                 eps: float) -> torch.Tensor:  # [M, K]
    """``RMSNorm.forward``: the variance in fp32, rounded to x's dtype before the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [M, 2I] -> [M, I]
    """``GatedMLP``'s fused form: rows of gate_up are [gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _plus(y: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    # The decoder writes ``hidden + branch(...)``: the residual is the left operand.
    return y if residual is None else residual + y


def linear_ref(x: torch.Tensor,  # [M, K]
               weight: torch.Tensor,  # [N, K]
               residual: torch.Tensor | None = None) -> torch.Tensor:  # [M, N]
    return _plus(F.linear(x, weight), residual)


def rmsnorm_linear_ref(x: torch.Tensor,  # [M, K]
                       norm_weight: torch.Tensor,  # [K]
                       eps: float,
                       weight: torch.Tensor,  # [N, K]
                       residual: torch.Tensor | None = None) -> torch.Tensor:  # [M, N]
    return _plus(F.linear(rms_norm_ref(x, norm_weight, eps), weight), residual)


def _normed(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return x if norm_weight is None else rms_norm_ref(x, norm_weight, eps)


def gated_linear_ref(x: torch.Tensor,  # [M, K]
                     norm_weight: torch.Tensor | None,  # [K], or None: no RMSNorm
                     eps: float,
                     weight: torch.Tensor,  # [2N, K] = [gate; up]
                     silu_mul: Callable[[torch.Tensor], torch.Tensor] = silu_mul_ref,
                     ) -> torch.Tensor:  # [M, N]: silu(gate) * up of (rmsnorm(x)) @ weight^T
    """``silu_mul``: the SiLU-and-mul to run (the GPU's prefill-sized path passes its kernel)."""
    return silu_mul(F.linear(_normed(x, norm_weight, eps), weight))


def qkv_rope_write_kv_ref(x: torch.Tensor,  # [M, K]
                          weight: torch.Tensor,  # [(heads + 2 kv heads) * head_dim, K]
                          k_cache: torch.Tensor,  # [num_blocks, page_size, kv_heads, head_dim]
                          v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor,  # [M] int64, -1 = skip
                          cos: torch.Tensor,  # [M, head_dim]
                          sin: torch.Tensor,  # [M, head_dim]
                          num_heads: int,
                          norm_weight: torch.Tensor | None,  # [K], or None: no RMSNorm
                          eps: float,
                          rope_write_kv: Callable[..., torch.Tensor] = rope_write_kv_ref,
                          ) -> torch.Tensor:  # [M, heads, head_dim] roped queries
    """The attention block's ``_write_qkv``: [RMSNorm ->] the fused qkv projection, viewed as
    heads and split, then ``rope_write_kv`` (the GPU's prefill-sized path passes its kernel:
    the reference's KV write selects rows on the host, no good inside a CUDA graph)."""
    head_dim, kv_heads = k_cache.shape[-1], k_cache.shape[-2]
    qkv = F.linear(_normed(x, norm_weight, eps), weight).view(x.shape[0],
                                                              num_heads + 2 * kv_heads, head_dim)
    return rope_write_kv(qkv[:, :num_heads + kv_heads], qkv[:, num_heads + kv_heads:],
                         k_cache, v_cache, slot_mapping, cos, sin, num_heads)
