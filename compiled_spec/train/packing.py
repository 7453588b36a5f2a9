"""Packed training batches: sequences back to back in one row of a fixed token budget.

One fixed shape per batch means the compiled attention and loss kernels compile once, and no
token is padding except the batch's tail. Each token carries its position within its sequence;
positions restart at 0 where a sequence starts, which is all the TTT attention mask and the loss
need to tell sequences apart. Which
sequences share a batch is ``data.pack_batches``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_spec.train.data import TrainSequence

ALIGN = 128  # budgets are rounded up to whole flex-attention blocks


def packed_budget(batch_tokens: int) -> int:
    return -(-batch_tokens // ALIGN) * ALIGN


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] int64, sequences back to back, zeros after them
    positions: torch.Tensor  # [T] int64 position within its sequence (0 on the tail)
    loss_mask: torch.Tensor  # [T] bool: the target's own tokens (never the tail)
    copyable: torch.Tensor  # [T] bool: TrainSequence.copyable (a context lookup predicts it)
    # [T] bool: loss tokens past the first ``tail_after`` of their reply span (collate_packed)
    tail: torch.Tensor
    lengths: list[int]  # per sequence, on the host
    num_tokens: int  # sum(lengths)


def collate_packed(seqs: list[TrainSequence], budget: int, device: torch.device | str,
                   tail_after: int | None = None) -> PackedBatch:
    """``tail_after``: mark each reply's tokens past its first ``tail_after`` as ``tail`` (the
    long replies' loops; None marks none)."""
    lens = [len(s.input_ids) for s in seqs]
    used = sum(lens)
    if used > budget:
        raise ValueError(f"{used} tokens do not fit a packed batch of {budget}")
    ids = torch.zeros(budget, dtype=torch.int64)
    pos = torch.zeros(budget, dtype=torch.int64)
    mask = torch.zeros(budget, dtype=torch.bool)
    copy = torch.zeros(budget, dtype=torch.bool)
    tail = torch.zeros(budget, dtype=torch.bool)
    at = 0
    for s, n in zip(seqs, lens):
        ids[at:at + n] = torch.tensor(s.input_ids, dtype=torch.int64)
        pos[at:at + n] = torch.arange(n)
        copy[at:at + n] = torch.tensor(s.copyable(), dtype=torch.bool)
        for a, b in s.loss_spans():
            mask[at + a:at + b] = True
            if tail_after is not None:
                tail[at + min(a + tail_after, b):at + b] = True
        at += n
    return PackedBatch(ids.to(device), pos.to(device), mask.to(device),
                       copy.to(device), tail.to(device), lens, used)
