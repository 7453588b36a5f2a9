"""Inference-time fusion of parallel projections: q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj``, as vLLM lays its weights out.

At batch 1 a decoder step is a chain of tiny kernels, so the number of launches is the cost:
three GEMVs over the same input become one, two become one. The fused weight is one new tensor
and the original layers' parameters become views of its rows, so memory does not grow and the
checkpoint names (``q_proj.weight`` ...) still read the same values (training code, state dicts
and tensor-parallel shards keep working). Only plain linears are fused (``nn.Linear`` or a
column-parallel shard, whose forward is ``F.linear`` on the local rows); parameters that require
grad (a head being trained) are left alone, since views would detach them from the optimizer.
"""
from __future__ import annotations

import torch
from torch import nn

from compiled_spec.distributed.layers import ColumnParallelLinear


def _fusable(layers: list[nn.Module]) -> bool:
    if not all(type(l) in (nn.Linear, ColumnParallelLinear) for l in layers):
        return False
    params = [p for l in layers for p in l.parameters(recurse=False)]
    first = layers[0].weight
    return (not any(p.requires_grad for p in params)
            and all(l.weight.shape[1] == first.shape[1] and l.weight.dtype == first.dtype
                    and l.weight.device == first.device for l in layers))


@torch.no_grad()
def fuse_linears(layers: list[nn.Module]) -> nn.Linear:
    """One linear whose output is the concatenation of ``layers``' outputs; each layer's
    parameters become views into the fused ones (no extra memory)."""
    weight = torch.cat([l.weight for l in layers], dim=0)  # [sum(out_i), in]
    biases = [l.bias for l in layers]
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else weight.new_zeros(l.weight.shape[0])
                          for b, l in zip(biases, layers)])  # [sum(out_i)]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    start = 0
    for l, b in zip(layers, biases):
        n = l.weight.shape[0]
        l.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if b is not None:
            l.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return fused


def fuse_projections(model: nn.Module) -> int:
    """Fuse every Attention's q/k/v and every GatedMLP's gate/up inside ``model`` (a target or a
    draft head) in place; returns how many fused layers were created. Idempotent."""
    from compiled_spec.models.decoder import Attention
    from compiled_spec.models.layers import GatedMLP

    fused = 0
    for m in model.modules():
        if isinstance(m, Attention) and m.qkv_proj is None:
            parts = [m.q_proj, m.k_proj, m.v_proj]
            if _fusable(parts):
                m.qkv_proj = fuse_linears(parts)
                fused += 1
        elif isinstance(m, GatedMLP) and m.gate_up_proj is None:
            parts = [m.gate_proj, m.up_proj]
            if _fusable(parts):
                m.gate_up_proj = fuse_linears(parts)
                fused += 1
    return fused
