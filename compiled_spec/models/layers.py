"""Building blocks shared by the decoder: RMSNorm, rotary embedding, gated SiLU MLP.

Numerics follow the Hugging Face Llama implementation (norm in fp32, cos/sin computed in fp32 and
cast to the activation dtype) so fp32 parity with transformers is exact up to matmul ordering.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels.ops  # noqa: F401  (registers compiled_spec::rope_table)
from compiled_spec.models.config import Llama3RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        # Accumulate the variance in fp32: bf16 squares lose too much precision.
        input_dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: Llama3RopeScaling | None) -> torch.Tensor:  # [head_dim // 2] fp32
    """Inverse frequencies, with Llama 3.1 scaling applied when configured (same formula as
    transformers' ``_compute_llama3_parameters``)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq
    old_ctx = scaling.original_max_position_embeddings
    low_freq_wavelen = old_ctx / scaling.low_freq_factor
    high_freq_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (beyond the original context) are stretched by `factor`; short ones kept.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    # The band in between blends the two smoothly so no frequency jumps.
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rope (rotate_half, like HF Llama) with a cos/sin table precomputed for every
    position up to ``max_positions`` so a forward only gathers rows by position: no per-step
    trig, and the flat token batch can hold any mix of positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: Llama3RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        # Non-persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.build_cache()

    @torch.no_grad()
    def build_cache(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables in fp32 on the CPU, then move them to ``device`` (default: the
        ambient default device, so building under ``torch.device('meta')`` stays lazy). The
        loader calls this again after materialising a meta-built model on its real device."""
        if device is None:
            device = torch.empty(0).device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)  # [head_dim // 2]
        pos = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * inv_freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos_cache = emb.cos().to(device)
        self.sin_cache = emb.sin().to(device)

    def forward(self, positions: torch.Tensor,  # [T] int64
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Gathered in fp32 then cast to the activation dtype, as HF does; one op, so that the
        # compiled graph holds one buffer of each that every layer reads (kernels/ops.py).
        cos, sin = torch.ops.compiled_spec.rope_table(positions, self.cos_cache, self.sin_cache,
                                                      dtype)  # [T, head_dim] each
        return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor,  # [T, heads, head_dim]
               cos: torch.Tensor,  # [T, head_dim]
               sin: torch.Tensor) -> torch.Tensor:  # [T, heads, head_dim]
    cos = cos[:, None, :]  # broadcast over heads
    sin = sin[:, None, :]
    return x * cos + rotate_half(x) * sin


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # Set by compiled_spec.models.fuse at inference: one GEMM for gate and up (rows are
        # [gate; up]); gate_proj / up_proj then hold views of its weight.
        self.gate_up_proj: nn.Linear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate] each
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
