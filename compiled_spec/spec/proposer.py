"""EAGLE chain proposer: one first pass over the target's accepted positions, then k-1 steps.

The first pass pairs each position i the target just accepted with the next token (ids shifted
left by one, hidden state i with token i+1) and writes the draft's KV there, overwriting what
earlier draft steps guessed. Each later step feeds back the draft's own hidden state, one token
per request. All metadata is built on the host from engine state before launching, so the loop
never waits on the device: the k-1 steps' metadata are built at once into one ``LiveBatch``
(positions / slots / seq_lens [k-1, B]) and ``run_loop`` runs the whole loop, which is what lets
``compiled_spec.engine.propose_graph`` capture the whole propose as one CUDA graph.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from capture.pad import LiveBatch
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.draft.model import EagleDraft
from compiled_spec.engine.batch import build_loop_metadata, build_metadata, to_device
from compiled_spec.kv_cache import BlockAllocator
from compiled_spec.spec.draft_pick import DraftPick
from compiled_spec.spec.first_pass_split import compact_rows, split_first_pass
from compiled_spec.spec.propose_batch import ProposeBatch  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from compiled_spec.engine.draft_prefill_graph import DraftPrefillGraphs
    from compiled_spec.engine.early_propose_graph import EarlyProposeGraphs
    from compiled_spec.engine.propose_graph import ProposeGraphs
    from compiled_spec.engine.sync_graph import SyncGraphs


class EagleProposer:
    def __init__(self, draft: EagleDraft, allocator: BlockAllocator, device: torch.device,
                 num_speculative_tokens: int, sample_drafts: bool, target_vocab_size: int) -> None:
        self.draft = draft
        # The callables the loop runs; compile=True swaps in compiled versions. The first pass
        # starts from the target's aux states (EAGLE-3's fc is part of it, and the compiler
        # hoists it back out to eager); later steps start from the draft's own hidden state.
        self.first_pass_fn = draft.forward_from_aux
        self.step_fn = draft
        # Steps 2..k: the draft step and its pick as one callable, so that under compile=True
        # the logits' fp32 cast, the argmax (or sampling) and the draft->target id map become
        # a few fused kernels after the lm_head instead of a string of eager ATen kernels.
        # A module of its own (spec/draft_pick.py), so that precompile can save its compile.
        self.picker = DraftPick(draft, num_speculative_tokens, sample_drafts, target_vocab_size)
        self.step_pick_fn = self.picker
        # An early step's pick and loop metadata (engine/early_propose_graph.py), also swapped.
        self.pick_plan_fn = self.picker.pick_and_plan
        # When set (compiled mode on CUDA), the whole propose replays as one CUDA graph per
        # batch size; calls it cannot take run the path below (and are counted there).
        self.graph: "ProposeGraphs | None" = None
        # Its variant for steps whose acceptance is still on the device (engine/early_propose.py).
        self.early_graph: "EarlyProposeGraphs | None" = None
        # Capture the first pass alone too (engines that may pause drafting: adaptive policy),
        self.capture_sync = False
        # ... for this many first-pass rows per request: a deferred flush's
        # (engine/deferred_first_pass.py); 0: k + 1
        self.sync_rows = 0
        # ... replayed from here (engine/sync_graph.py) once captured
        self.sync_graph: "SyncGraphs | None" = None
        # A prompt's first pass before the propose graph's k + 1 positions, and a paused
        # prompt step's whole first pass (engine/draft_prefill_graph.py), once captured.
        self.prefill_graph: "DraftPrefillGraphs | None" = None
        # (target_hidden, its fc output) issued early by ``precombine``, taken by ``combine``.
        self._pre: tuple[object, torch.Tensor] | None = None
        self.allocator = allocator
        self.device = device
        self.k = num_speculative_tokens
        self.sample_drafts = sample_drafts
        self.target_vocab_size = target_vocab_size
        self.layer_names = draft.layer_names

    def precombine(self, target_hidden: list[torch.Tensor], active: bool | None = None,
                   out: torch.Tensor | None = None) -> None:
        """Issue EAGLE-3's fc over the step's target rows right after the verify forward, before
        the host waits for the acceptance: the fc does not depend on which drafts are accepted,
        so it runs on the GPU while the host waits, instead of on the critical path between the
        acceptance and the next proposal (the graph paths run it over every target row anyway).
        ``active``: whether a graph path will take it (default: this proposer has graphs).
        ``out``: where the fc writes (default: the chain graphs' hidden input, ``fc_out``), so
        the replay reading it copies nothing. The graphs that read that buffer ran before this
        verify's launch (stream order); the next to read it is the proposal of these states."""
        self._pre = None
        if self.graph is not None if active is None else active:
            aux = target_hidden if isinstance(target_hidden, list) else [target_hidden]
            if out is None and self.graph is not None:
                out = self.graph.fc_out(aux[0].shape[0])
            self._pre = (target_hidden, self.draft.combine_aux(aux, out))

    def combine(self, target_hidden: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        """The draft's incoming hidden for every target row ([T, h]): what ``precombine``
        issued for this same ``target_hidden``, else computed now."""
        pre, self._pre = self._pre, None
        if pre is not None and pre[0] is target_hidden:
            return pre[1]
        aux = target_hidden if isinstance(target_hidden, list) else [target_hidden]
        return self.draft.combine_aux(aux)

    def _metas(self, meta: AttentionMetadata) -> dict[str, AttentionMetadata]:
        return self.picker.metas(meta)

    def run_loop(self, b: LiveBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft steps 2..k: ``b.input_ids`` [B] the first drafts, extras ``feed`` [B, h] (their
        hidden), ``temperature`` [B], ``seeds`` [B]; b.step(j) the metadata of step j + 2. A fixed
        trip count with no host reads, so a CUDA graph can capture it whole."""
        tok, feed = b.input_ids, b.extras["feed"]
        tokens, probs = [], []
        for j in range(b.num_steps):
            positions, meta = b.step(j)  # [B]
            feed, tok, q = self.step_pick_fn(tok, feed, positions, meta,
                                             b.extras["temperature"], b.extras["seeds"])
            tokens.append(tok)
            probs.append(q)
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if self.sample_drafts
                                            else None)

    @torch.inference_mode()
    def sync(self, batch: ProposeBatch, target_hidden: torch.Tensor | list[torch.Tensor]) -> None:
        """The first pass alone, no drafting: the draft's KV at the accepted positions is
        written as a proposal would write it, so drafting can resume later with its context
        complete (a paused step of the adaptive policy; no logits, no loop). A first-pass
        graph runs it where one was captured for the batch (its misses are in its stats); a
        prompt's, longer than those graphs hold, the prompt graphs."""
        g = self.sync_graph
        if g is not None and g.too_long(batch) and self._prefill_pass(batch, target_hidden):
            return
        if g is None or not g.run(batch, target_hidden):
            self.first_pass(batch, target_hidden)

    def _prefill_pass(self, batch: ProposeBatch,
                      target_hidden: torch.Tensor | list[torch.Tensor]) -> bool:
        """The draft KV at ``batch``'s first-pass positions through the prompt graphs (their
        misses run uncaptured and are counted there); False when there are none, or the step's
        target rows exceed their buffer: the caller runs ``first_pass``."""
        g = self.prefill_graph
        return g is not None and g.enabled and g.run(batch, target_hidden)

    def first_pass(self, batch: ProposeBatch, target_hidden: torch.Tensor | list[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The uncaptured first pass over ``batch``'s accepted positions, writing the draft's KV
        there: (feed [T, h], for_logits [T, h], positions [T], metadata)."""
        rows = to_device(batch.hidden_rows, self.device)
        # EAGLE-3: the aux states (fused by fc); EAGLE-1: the target's final hidden state.
        aux = [h[rows] for h in target_hidden] if isinstance(target_hidden, list) else [target_hidden[rows]]
        ids = to_device(batch.token_ids, self.device)  # [T]
        positions, meta = build_metadata(self.allocator, batch.first_pass, self.device)
        feed, for_logits = self.first_pass_fn(aux, ids, positions, self._metas(meta))
        return feed, for_logits, positions, meta

    def cut_first_pass(self, batch: ProposeBatch,
                       target_hidden: torch.Tensor | list[torch.Tensor], q: int
                       ) -> tuple[ProposeBatch, torch.Tensor | list[torch.Tensor]]:
        """``batch`` cut to at most ``q`` first-pass positions per request, for a graph: the
        positions before run now, through the prompt graphs or uncaptured (their draft KV is
        all that is needed), and the target rows the rest reads gathered
        (compiled_spec/spec/first_pass_split.py)."""
        pre, batch = split_first_pass(batch, q)
        if pre is None:
            return batch, target_hidden
        # The rest's target rows gathered first: a prompt graph's replay may reuse the graph
        # memory the target's outputs live in.
        rest = compact_rows(batch, target_hidden, self.device)
        self.write_head(pre, target_hidden)
        return rest

    def prompt_head_rows(self) -> int | None:
        """First-pass positions per request the graphed proposal takes (k + 1): a prompt's
        positions before them, its head, go through ``write_head`` first (here in
        ``cut_first_pass``, or before the host's wait: engine/prompt_head.py). None without
        graphs: the proposal then runs every first pass uncaptured."""
        return self.k + 1 if self.graph is not None and self.graph.enabled else None

    def write_head(self, pre: ProposeBatch,
                   target_hidden: torch.Tensor | list[torch.Tensor]) -> None:
        """The draft KV at ``pre``'s first-pass positions (its outputs unused): the prompt
        graphs where they hold it, else the uncaptured first pass."""
        if not self._prefill_pass(pre, target_hidden):
            self.first_pass(pre, target_hidden)

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch, target_hidden: torch.Tensor | list[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns draft tokens [B, k] (target vocab) and, when drafts are sampled, their
        probabilities [B, k, target_vocab]."""
        if self.graph is not None:
            if self.graph.enabled:  # a prompt's first pass: its head eager, the rest replayed
                batch, target_hidden = self.cut_first_pass(batch, target_hidden, self.k + 1)
            out = self.graph.run(batch, target_hidden)
            if out is not None:
                return out
        temperature = torch.tensor(batch.temperature, dtype=torch.float32, device=self.device)
        seeds = torch.tensor(batch.seeds, dtype=torch.int64, device=self.device)
        feed, for_logits, positions, meta = self.first_pass(batch, target_hidden)
        last = (meta.query_start_loc[1:] - 1).long()  # [B] each request's last first-pass row
        feed = feed[last]  # [B, h]
        # Position of the token being drafted: d_1 sits right after the last committed token.
        next_pos = positions[last] + 2
        tok, q = self.picker.pick(self.draft.compute_logits(for_logits[last]), temperature,
                                  seeds, next_pos)
        if self.k == 1:
            return tok[:, None], (q[:, None] if self.sample_drafts else None)
        loop_pos, loop_meta = build_loop_metadata(self.allocator, batch.first_pass,
                                                  batch.step_limits, self.k - 1, self.device)
        rest, rest_q = self.run_loop(LiveBatch(
            input_ids=tok, positions=loop_pos, meta=loop_meta,
            extras={"feed": feed, "temperature": temperature, "seeds": seeds}))
        drafts = torch.cat([tok[:, None], rest], dim=1)  # [B, k]
        return drafts, (torch.cat([q[:, None], rest_q], dim=1) if self.sample_drafts else None)
