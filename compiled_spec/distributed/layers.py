"""Sharded layers, built from the full (loaded) layer by slicing this rank's part.

Column parallel: output features split, no communication (the next row-parallel layer consumes
the split). Row parallel: input features split, partial products summed by all-reduce; the bias
is added once, after it. Vocabulary parallel: rows of the embedding / lm_head split; lookups of
ids outside the shard give zeros and are summed across ranks, logits are all-gathered. Every
rank ends with bit-identical activations and logits (an all-reduce / all-gather returns the same
buffer to everyone), which is what keeps sampling and acceptance identical across ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from compiled_spec.distributed.group import TPGroup


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, tp: TPGroup, what: str) -> None:
        super().__init__()
        n = tp.split(full.out_features, what)
        lo = tp.rank * n
        self.weight = _param(full.weight[lo:lo + n])  # [out/tp, in]
        self.bias = _param(full.bias[lo:lo + n]) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out/tp]
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    def __init__(self, full: nn.Linear, tp: TPGroup, what: str) -> None:
        super().__init__()
        n = tp.split(full.in_features, what)
        lo = tp.rank * n
        self.tp = tp
        self.weight = _param(full.weight[:, lo:lo + n])  # [out, in/tp]
        self.bias = _param(full.bias) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/tp] -> [T, out]
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.tp.group)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    def __init__(self, full: nn.Embedding, tp: TPGroup) -> None:
        super().__init__()
        n = tp.split(full.num_embeddings, "vocab_size")
        self.tp, self.lo, self.n = tp, tp.rank * n, n
        self.weight = _param(full.weight[self.lo:self.lo + n])  # [V/tp, h]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, h]
        local = ids - self.lo
        mine = (local >= 0) & (local < self.n)
        out = F.embedding(local.clamp(0, self.n - 1), self.weight) * mine[:, None].to(
            self.weight.dtype)
        dist.all_reduce(out, group=self.tp.group)
        return out


class ParallelLMHead(nn.Module):
    def __init__(self, weight: torch.Tensor | nn.Parameter, tp: TPGroup) -> None:
        """``weight``: this rank's [V/tp, h] rows (shared with the embedding when tied)."""
        super().__init__()
        self.tp = tp
        self.weight = weight if isinstance(weight, nn.Parameter) else _param(weight)

    def full_weight(self) -> torch.Tensor:  # [V, h], the same on every rank
        """Every rank's rows gathered (a collective: all ranks call it together), for readers of
        the whole readout such as a draft head whose lm_head is the target's rows."""
        parts = [torch.empty_like(self.weight) for _ in range(self.tp.world_size)]
        dist.all_gather(parts, self.weight.detach().contiguous(), group=self.tp.group)
        return torch.cat(parts, dim=0)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # [T, h] -> [T, V]
        local = F.linear(h, self.weight)  # [T, V/tp]
        parts = [torch.empty_like(local) for _ in range(self.tp.world_size)]
        dist.all_gather(parts, local.contiguous(), group=self.tp.group)
        return torch.cat(parts, dim=-1)
