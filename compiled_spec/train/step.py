"""One TTT loss evaluation on a list of sequences: features, batch layout and loss, shared by
the training loop and the held-out evaluation.

``packed`` (default): sequences back to back in a fixed budget of tokens, block-sparse flex
attention on the GPU, fused chunked soft cross-entropy (``ttt_packed.py``). ``padded``: the
[B, S] reference (``ttt.py``), dense masks and unfused loss; kept as the readable definition the
packed path is tested against and as a fallback.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch

from compiled_spec.draft.model import EagleDraft
from compiled_spec.train.data import TrainSequence, collate, pack_batches
from compiled_spec.train.features import TargetFeaturizer
from compiled_spec.train.packing import collate_packed, packed_budget
from compiled_spec.train.ttt import TTTOutput, ttt_loss
from compiled_spec.train.ttt_packed import packed_ttt_loss

if TYPE_CHECKING:
    from compiled_spec.train.config import TrainConfig


class TTTStep:
    def __init__(self, feats: TargetFeaturizer, cfg: "TrainConfig") -> None:
        self.feats, self.cfg = feats, cfg
        self.device = feats.head.device
        self.packed = cfg.ttt_impl == "packed"
        self.budget = packed_budget(cfg.batch_tokens or cfg.batch_size * cfg.max_seq_len)
        cuda = self.device.type == "cuda"
        # flex attention has no CPU backward: the CPU runs the same mask densely.
        self.flex = cuda
        self.compiled_ce = cuda
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16)
                         if cuda and feats.head.dtype == torch.bfloat16 else nullcontext())

    def __call__(self, draft: EagleDraft, seqs: list[TrainSequence]) -> tuple[TTTOutput, int]:
        """(the TTT loss of ``seqs`` as one batch, its real token count)."""
        cfg = self.cfg
        if self.packed:
            batch = collate_packed(seqs, self.budget, self.device, cfg.tail_after)
            aux, final = self.feats.packed(batch)  # [T, 3h], [T, h]
            with self.autocast:
                res = packed_ttt_loss(draft, batch, aux, final, self.feats.head, cfg.ttt_steps,
                                      cfg.ttt_decay, self.flex, cfg.ce_chunk, self.compiled_ce,
                                      cfg.copy_weight, cfg.tail_weight,
                                      cfg.label_temperature, cfg.compile_ttt)
            return res, batch.num_tokens
        batch = collate(seqs, self.device)
        aux, tlogits = self.feats(batch.input_ids, batch.lengths)  # [B,S,3h], [B,S,V_draft]
        with self.autocast:
            res = ttt_loss(draft, batch.input_ids, aux, tlogits, batch.loss_mask, cfg.ttt_steps,
                           cfg.ttt_decay)
        return res, batch.num_tokens

    def eval_batches(self, seqs: list[TrainSequence]) -> list[list[TrainSequence]]:
        """Held-out batches: packed into the training budget (a fixed order), or runs of
        batch_size sequences."""
        if self.packed:
            plan = pack_batches([len(s.input_ids) for s in seqs], self.budget, seed=0)
            return [[seqs[i] for i in b] for b in plan]
        n = self.cfg.batch_size
        return [seqs[i:i + n] for i in range(0, len(seqs), n)]
