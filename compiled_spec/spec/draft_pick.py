"""A draft step's pick (the next draft token from the draft's logits) as a module of its own.

Why a module and not proposer methods: compile=True compiles ``forward`` (steps 2..k: draft step
+ pick) and ``pick_and_plan`` (an early step's pick + loop metadata) as callables of their own,
and precompile (compiled_spec/precompile.py) saves a compiled callable only when it is a module's
method whose state Dynamo's guards can serialize. The proposer holds the engine's allocator,
graphs and the other compiled callables, which they cannot; this module holds only the draft and
a few settings.
"""
from __future__ import annotations

import torch

from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.draft.model import EagleDraft
from compiled_spec.spec.argmax import rowwise_argmax
from compiled_spec.spec.rejection import sample_draft


class DraftPick(torch.nn.Module):
    def __init__(self, draft: EagleDraft, num_speculative_tokens: int, sample_drafts: bool,
                 target_vocab_size: int) -> None:
        super().__init__()
        self.draft = draft
        self.k = num_speculative_tokens
        self.sample_drafts = sample_drafts
        self.target_vocab_size = target_vocab_size

    def metas(self, meta: AttentionMetadata) -> dict[str, AttentionMetadata]:
        # Every draft layer has its own KV tensors but the same slots, so one metadata object
        # is bound to each layer by name.
        return {name: meta for name in self.draft.layer_names}

    def pick(self, logits: torch.Tensor,  # [B, draft_vocab]
             temperature: torch.Tensor,  # [B] fp32, 0 = greedy
             seeds: torch.Tensor,  # [B] int64
             positions: torch.Tensor,  # [B] position of the token being drafted
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> ([B] target-vocab draft ids, [B, target_vocab] q or None). On-device only."""
        if not self.sample_drafts:  # two-stage argmax: wide enough to fill the GPU (argmax.py)
            return self.draft.draft_to_target(rowwise_argmax(logits)), None
        greedy = temperature == 0
        temp = torch.where(greedy, torch.ones_like(temperature), temperature)
        q = torch.softmax(logits / temp[:, None], dim=-1)  # [B, draft_vocab]
        one_hot = torch.zeros_like(q).scatter_(1, rowwise_argmax(logits)[:, None], 1.0)
        q = torch.where(greedy[:, None], one_hot, q)
        tok = sample_draft(q, seeds, positions)
        q_target = self.draft.draft_vocab_to_target_probs(q, self.target_vocab_size)
        return self.draft.draft_to_target(tok), q_target

    def forward(self, tok: torch.Tensor,  # [B] drafts of the previous step
                feed: torch.Tensor,  # [B, h] their hidden states
                positions: torch.Tensor,  # [B]
                meta: AttentionMetadata,
                temperature: torch.Tensor,  # [B] fp32
                seeds: torch.Tensor,  # [B] int64
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One draft step: (feed_back [B, h], next drafts [B], their q [B, V] or None)."""
        feed, for_logits = self.draft(tok, feed, positions, self.metas(meta))
        # The token drafted here sits two past this step's input position.
        tok, q = self.pick(self.draft.compute_logits(for_logits), temperature, seeds,
                           positions + 2)
        return feed, tok, q

    def pick_and_plan(self, for_logits: torch.Tensor,  # [R, h] the first pass's rows
                      positions: torch.Tensor,  # [R] their positions
                      last: torch.Tensor,  # [B] each request's row its chain continues from
                      feed: torch.Tensor,  # [R, h] the first pass's hidden states
                      temperature: torch.Tensor, seeds: torch.Tensor,  # [B]
                      start: torch.Tensor,  # [B] int64 each request's first verified position
                      live32: torch.Tensor,  # [B] int32, 0 = padded row
                      m: torch.Tensor,  # [B] accepted target positions (n_acc + 1)
                      max_total: torch.Tensor,  # [B] each request's token budget
                      tables: torch.Tensor,  # [B, W] int32
                      page: int, max_blocks: int) -> tuple[torch.Tensor, ...]:
        """An early step's first drafts and the metadata of steps 2..k, from the device's
        acceptance (engine/early_propose_graph.py): one callable, so that compile=True makes
        the pick and the ~40 small ops of the loop's positions, slots and lengths a few fused
        kernels (H200 trace, eleventh session). -> (tok [B], q [B, V] or None, feed [B, h],
        positions, slots, seq_lens [k-1, B]; positions >= a request's limit are inert)."""
        tok, pq = self.pick(self.draft.compute_logits(for_logits[last]), temperature, seeds,
                            positions[last] + 2)
        live = live32 != 0
        n_tok = start + 1 + m
        k_next = torch.clamp(torch.clamp(max_total - n_tok - 1, max=self.k), min=0)
        limit = n_tok - 2 + k_next  # [B] positions >= this are inert in the loop
        s = torch.arange(1, self.k, device=start.device)  # [k-1] steps 2..k
        pos = (start + m - 1)[None, :] + s[:, None]  # [k-1, B]
        writes = (pos < limit[None, :]) & live[None, :]
        pos = torch.clamp(torch.where(pos < limit[None, :], pos, (limit - 1)[None, :]), min=0)
        col = (pos // page).clamp(max=max_blocks - 1)  # [k-1, B]
        block = tables.gather(1, col.t()).t().long()  # [k-1, B]
        slots = torch.where(writes, block * page + pos % page, -1)
        lens = torch.where(live[None, :], pos + 1, 0)
        return tok, pq, feed[last], pos, slots, lens
