"""Held-out prompts: which ones are held out, and the draft's TTT loss and accuracy on them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from compiled_spec.draft.model import EagleDraft
from compiled_spec.train.data import TrainSequence

if TYPE_CHECKING:
    from compiled_spec.train.step import TTTStep


def split_prompts(rows: list, num_val: int, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded random ``num_val`` of the prompts are held out."""
    if num_val >= len(rows):
        raise ValueError(f"val_prompts={num_val} leaves no training prompts of {len(rows)}")
    g = torch.Generator().manual_seed(seed + 4099)
    held = set(torch.randperm(len(rows), generator=g)[:num_val].tolist())
    return ([r for i, r in enumerate(rows) if i not in held],
            [r for i, r in enumerate(rows) if i in held])


@dataclass
class HeldOut:
    loss: float  # decay-weighted TTT loss, as trained
    accuracy: list[float]  # per TTT step, over every held-out sequence
    accuracy_by_kind: dict[str, list[float]]  # the same per prompt kind (prose, code, ...)
    # Over positions a context lookup does not predict (TrainSequence.copyable; packed step
    # only, else empty): the target's loops inflate the plain figure, MT-bench has fewer.
    accuracy_novel: list[float] = field(default_factory=list)


@torch.no_grad()
def evaluate(draft: EagleDraft, step: "TTTStep", seqs: list[TrainSequence]) -> HeldOut:
    """Held-out TTT loss and per-step top-1 accuracy (weighted by the number of scored
    positions), overall and per kind: batches are formed within a kind, so each kind's figure
    is exact rather than sampled from mixed batches."""
    was_training = draft.training
    draft.eval()
    n_steps, decay = step.cfg.ttt_steps, step.cfg.ttt_decay
    by_kind: dict[str, list[TrainSequence]] = {}
    for s in seqs:
        by_kind.setdefault(s.kind or "unknown", []).append(s)
    loss_sums = [0.0] * n_steps
    novel = [[0.0] * n_steps, [0] * n_steps]  # hits, counts
    sums: dict[str, tuple[list[float], list[int]]] = {}
    for kind, group in sorted(by_kind.items()):
        hits, counts = [0.0] * n_steps, [0] * n_steps
        for batch in step.eval_batches(group):
            res, _ = step(draft, batch)
            for i, (l, a, n) in enumerate(zip(res.step_losses, res.step_accuracy,
                                              res.step_counts)):
                loss_sums[i] += l * n  # step means -> sums, so batches weigh by positions
                hits[i] += a * n
                counts[i] += n
            for i, (a, n) in enumerate(zip(res.step_accuracy_novel, res.step_counts_novel)):
                novel[0][i] += a * n
                novel[1][i] += n
        sums[kind] = (hits, counts)
    draft.train(was_training)
    counts = [sum(c[i] for _, c in sums.values()) for i in range(n_steps)]
    hits = [sum(h[i] for h, _ in sums.values()) for i in range(n_steps)]
    loss = sum(decay ** i * ls / max(c, 1)
               for i, (ls, c) in enumerate(zip(loss_sums, counts)))
    return HeldOut(loss, [h / max(c, 1) for h, c in zip(hits, counts)],
                   {k: [h / max(c, 1) for h, c in zip(*v)] for k, v in sums.items()},
                   [h / max(c, 1) for h, c in zip(*novel)] if any(novel[1]) else [])
