"""Held-out prompts: which ones are held out, and the draft's TTT loss and accuracy on them."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from compiled_spec.draft.model import EagleDraft
from compiled_spec.train.data import TrainSequence, collate
from compiled_spec.train.features import TargetFeaturizer
from compiled_spec.train.ttt import ttt_loss

if TYPE_CHECKING:
    from compiled_spec.train.trainer import TrainConfig


def split_prompts(rows: list, num_val: int, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded random ``num_val`` of the prompts are held out."""
    if num_val >= len(rows):
        raise ValueError(f"val_prompts={num_val} leaves no training prompts of {len(rows)}")
    g = torch.Generator().manual_seed(seed + 4099)
    held = set(torch.randperm(len(rows), generator=g)[:num_val].tolist())
    return ([r for i, r in enumerate(rows) if i not in held],
            [r for i, r in enumerate(rows) if i in held])


@torch.no_grad()
def evaluate(draft: EagleDraft, feats: TargetFeaturizer, seqs: list[TrainSequence],
             cfg: "TrainConfig", autocast) -> tuple[float, list[float]]:
    """Held-out TTT loss (decay-weighted, as trained) and per-step top-1 accuracy, weighted by
    the number of scored positions."""
    was_training = draft.training
    draft.eval()
    n_steps = cfg.ttt_steps
    loss_sums, hits, counts = [0.0] * n_steps, [0.0] * n_steps, [0] * n_steps
    for start in range(0, len(seqs), cfg.batch_size):
        batch = collate(seqs[start:start + cfg.batch_size], feats.head.device)
        aux, tlogits = feats(batch.input_ids, batch.lengths)
        with autocast:
            res = ttt_loss(draft, batch.input_ids, aux, tlogits, batch.loss_mask,
                           n_steps, cfg.ttt_decay)
        for i, (l, a, n) in enumerate(zip(res.step_losses, res.step_accuracy, res.step_counts)):
            loss_sums[i] += l * n  # step means -> sums, so batches weigh by their positions
            hits[i] += a * n
            counts[i] += n
    draft.train(was_training)
    loss = sum(cfg.ttt_decay ** i * ls / max(c, 1)
               for i, (ls, c) in enumerate(zip(loss_sums, counts)))
    return loss, [h / max(c, 1) for h, c in zip(hits, counts)]


