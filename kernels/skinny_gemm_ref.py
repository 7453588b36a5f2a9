"""Exact PyTorch references of the fused skinny-GEMM ops: the very ops the unfused model runs
(``compiled_spec.models.layers``: RMSNorm, GatedMLP; the decoder's ``hidden + ...``), so the CPU
path of a rewritten graph computes bit for bit what the original graph did."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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


def silu_mul_linear_ref(gate_up: torch.Tensor,  # [M, 2K]
                        weight: torch.Tensor,  # [N, K]
                        residual: torch.Tensor | None = None) -> torch.Tensor:  # [M, N]
    return _plus(F.linear(silu_mul_ref(gate_up), weight), residual)
