"""EAGLE chain proposer: one first pass over the target's accepted positions, then k-1 steps.

The first pass pairs each position i the target just accepted with the next token (ids shifted
left by one, hidden state i with token i+1) and writes the draft's KV there, overwriting what
earlier draft steps guessed. Each later step feeds back the draft's own hidden state, one token
per request. All metadata is built on the host from engine state before launching, so the loop
never waits on the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.draft.model import EagleDraft
from compiled_spec.engine.batch import Span, build_metadata, to_device
from compiled_spec.kv_cache import BlockAllocator
from compiled_spec.spec.rejection import sample_draft


@dataclass
class ProposeBatch:
    """One propose call. Row b of the result belongs to ``first_pass[b].req_id``."""

    first_pass: list[Span]  # accepted target positions per request
    token_ids: list[int]  # [sum of first-pass lengths]: the token after each position
    hidden_rows: list[int]  # rows of the target's hidden states, same order as token_ids
    step_limits: list[int]  # per request: positions >= this are inert in steps 2..k
    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    seeds: torch.Tensor  # [B] int64


class EagleProposer:
    def __init__(self, draft: EagleDraft, allocator: BlockAllocator, device: torch.device,
                 num_speculative_tokens: int, sample_drafts: bool, target_vocab_size: int) -> None:
        self.draft = draft
        # The callables the loop runs; compile=True swaps in compiled versions. The first pass
        # starts from the target's aux states (EAGLE-3's fc is part of it, and the compiler
        # hoists it back out to eager); later steps start from the draft's own hidden state.
        self.first_pass_fn = draft.forward_from_aux
        self.step_fn = draft
        self.allocator = allocator
        self.device = device
        self.k = num_speculative_tokens
        self.sample_drafts = sample_drafts
        self.target_vocab_size = target_vocab_size
        self.layer_names = draft.layer_names

    def _metas(self, meta: AttentionMetadata) -> dict[str, AttentionMetadata]:
        # Every draft layer has its own KV tensors but the same slots, so one metadata object
        # is bound to each layer by name.
        return {name: meta for name in self.layer_names}

    def _pick(self, logits: torch.Tensor, batch: ProposeBatch, positions: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, draft_vocab] logits -> ([B] target-vocab draft ids, [B, target_vocab] q or None)."""
        if not self.sample_drafts:
            return self.draft.draft_to_target(logits.argmax(dim=-1)), None
        greedy = batch.temperature == 0
        temp = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
        q = torch.softmax(logits / temp[:, None], dim=-1)  # [B, draft_vocab]
        one_hot = torch.zeros_like(q).scatter_(1, logits.argmax(-1, keepdim=True), 1.0)
        q = torch.where(greedy[:, None], one_hot, q)
        tok = sample_draft(q, batch.seeds, positions)
        q_target = self.draft.draft_vocab_to_target_probs(q, self.target_vocab_size)
        return self.draft.draft_to_target(tok), q_target

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch, target_hidden: torch.Tensor | list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns draft tokens [B, k] (target vocab) and, when drafts are sampled, their
        probabilities [B, k, target_vocab]."""
        rows = to_device(batch.hidden_rows, self.device)
        # EAGLE-3: the aux states (fused by fc); EAGLE-1: the target's final hidden state.
        aux = [h[rows] for h in target_hidden] if isinstance(target_hidden, list) else [target_hidden[rows]]
        ids = to_device(batch.token_ids, self.device)  # [T]
        positions, meta = build_metadata(self.allocator, batch.first_pass, self.device)
        feed, for_logits = self.first_pass_fn(aux, ids, positions, self._metas(meta))
        ends, total = [], 0
        for s in batch.first_pass:
            total += s.length
            ends.append(total - 1)
        last = to_device(ends, self.device)
        feed = feed[last]  # [B, h]
        # Position of the token being drafted: d_1 sits right after the last committed token.
        next_pos = [s.start + s.length + 1 for s in batch.first_pass]
        tok, q = self._pick(self.draft.compute_logits(for_logits[last]), batch,
                            to_device(next_pos, self.device))
        tokens, probs = [tok], [q]
        for j in range(1, self.k):
            spans = [Span(s.req_id, s.start + s.length - 1 + j, 1, lim)
                     for s, lim in zip(batch.first_pass, batch.step_limits)]
            positions, meta = build_metadata(self.allocator, spans, self.device)
            feed, for_logits = self.step_fn(tok, feed, positions, self._metas(meta))
            tok, q = self._pick(self.draft.compute_logits(for_logits), batch,
                                to_device([p + j for p in next_pos], self.device))
            tokens.append(tok)
            probs.append(q)
        drafts = torch.stack(tokens, dim=1)  # [B, k]
        return drafts, (torch.stack(probs, dim=1) if self.sample_drafts else None)
