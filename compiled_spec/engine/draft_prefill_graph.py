"""The draft's first pass over a prompt as CUDA graphs (issue 16): ``draft_prefill_<T>``.

A prompt step's proposal runs the draft's first pass over every prompt position, to write the
draft's KV there. The propose graph takes only the last k + 1 of them
(``spec/first_pass_split.py``; a tree's first-pass graph the last num_steps + 1); the
positions before ran uncaptured: the compiled draft layer called from Python, each of its
custom ops dispatched through ``torch.library`` at ~100-200 us of host time apiece. On the
H100 (fifty-first session, random SmolLM2-shaped target and EAGLE-3 head, batch 1) that made
an EAGLE engine's prompt step 5.8 ms against vanilla's 1.4 ms, 4.2 ms of it the proposal's
host time; an adaptive engine's paused prompt step (the first pass alone,
``EagleProposer.sync``) 4.8 ms. With these graphs: 1.87 and 1.95 ms against vanilla's 1.52,
in one call (profiles/results/2026-12-07_h100_session51/).

Here that leading part replays a varlen graph: one ``GraphRunner`` per token count T (the
target's prompt-graph sizes: ``capture.policy.prefill_sizes`` and, with several sequences,
``mixed_sizes``), each of up to max(2, max_num_seqs) sequences of at most min(T, largest
prompt length) query tokens, at the largest max_seq_len bucket (the draft's attention is one
layer: shorter buckets would buy little for their captures). EAGLE-3's fc runs eagerly before
the replay over every target row of the step, into the row source ``hidden``, and the graph
gathers the rows it reads by the host-staged ``rows``. Only the KV writes matter: the graph
returns nothing. Its graphs share the engine's pool: the caller gathers what it still needs of
the target's outputs before the replay (``EagleProposer.cut_first_pass``).

A step no graph holds (a prompt past the largest query length, more tokens than the largest
size, more target rows than the row source) runs uncaptured and is counted under its reason,
as every other component's misses. Like the target's prompt graphs these are not required: a
failed capture leaves its prompts uncaptured, counted, and start-up goes on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from capture import GraphRunner, LiveBatch, StaticBuffers
from compiled_spec.engine.batch import build_host_batch, host_batch_to_device, to_device

if TYPE_CHECKING:
    from capture import CapturePolicy
    from compiled_spec.spec.propose_batch import ProposeBatch
    from compiled_spec.spec.proposer import EagleProposer

NAME = "draft_prefill"  # component names: draft_prefill_<token count>


class DraftPrefillGraphs:
    """The first pass over prompt positions, KV writes only: ``run`` replays it or says no."""

    def __init__(self, reg: Callable[..., GraphRunner], prop: "EagleProposer",
                 sizes: tuple[int, ...], query_len: int, max_seqs: int, max_blocks: int,
                 source_rows: int, bucket: int, dtype: torch.dtype,
                 inference_buffers: bool = True) -> None:
        """``sizes``: token counts; ``query_len``: the longest prompt one sequence may bring
        (a graph of T tokens holds min(T, query_len)); ``source_rows``: the target rows of the
        largest step the fc output buffer holds; ``inference_buffers``: whether the engine's
        other graphs call the draft step on inference tensors (a chain's propose graphs) or
        on plain ones (a tree's ``StaticBuffers``)."""
        self.prop = prop
        sizes = tuple(sorted(set(sizes)))
        seqs = max(2, max_seqs)  # one live sequence and padding: no 0/1 specialization
        # Tensors of the same kind as the other graphs' inputs to the draft step: the compiled
        # step guards on their dispatch keys, and the other kind would compile it a second
        # time. Only ``run`` (in inference mode) and the captures write them.
        with torch.inference_mode(inference_buffers):
            bufs = StaticBuffers(sizes[-1], seqs, max_blocks, prop.device, row_sources={
                "hidden": (max(source_rows, sizes[-1]), (prop.draft.config.hidden_size,),
                           dtype)})
        self.hidden = bufs.extras["hidden"]  # [R, h]: the fc output of the step's target rows
        self.runners = [reg(f"{NAME}_{t}", self._body, [t], bufs, query_len=min(t, query_len),
                            seqs=seqs, seq_len_buckets=(bucket,)) for t in sizes]

    @classmethod
    def for_policy(cls, reg: Callable[..., GraphRunner], prop: "EagleProposer",
                   policy: "CapturePolicy", varlen: bool, max_blocks: int, rows_per_request: int,
                   dtype: torch.dtype, tree: bool = False) -> "DraftPrefillGraphs | None":
        """The graphs at the target's prompt-graph token counts (one-sequence sizes, and the
        varlen ones where ``varlen``), None where it has none. ``rows_per_request``: the
        target rows a running request brings to a step (k + 1; a tree's node count);
        ``tree``: for a draft-tree engine."""
        sizes = policy.prefill_sizes + (policy.mixed_sizes if varlen else ())
        if not sizes:
            return None
        longest = max(policy.prefill_sizes[-1] if policy.prefill_sizes else 0,
                      policy.mixed_query_len if varlen else 0)
        max_seqs = policy.batch_sizes[-1]
        return cls(reg, prop, sizes, longest, max_seqs, max_blocks,
                   max(sizes) + max_seqs * rows_per_request, policy.seq_len_buckets[-1], dtype,
                   inference_buffers=not tree)

    @property
    def enabled(self) -> bool:
        """Graphs exist (CUDA, or emulated in tests); else the callers' own first pass runs."""
        return self.runners[0].enabled

    def _body(self, b: LiveBatch) -> tuple[()]:
        hidden = b.extras["hidden"].index_select(0, b.rows)  # [T, h] the rows each position reads
        # prop.step_fn is read per call: compiled or eager, as compile.use_compiled set it.
        self.prop.step_fn(b.input_ids, hidden, b.positions,
                          {name: b.meta for name in self.prop.layer_names})
        return ()

    def _runner(self, tokens: int, max_query_len: int) -> GraphRunner:
        """The smallest graph that holds the step; else the largest, which counts the miss."""
        return next((r for r in self.runners
                     if r.sizes[0] >= tokens and r.query_len >= max_query_len), self.runners[-1])

    @torch.inference_mode()
    def run(self, batch: "ProposeBatch", target_hidden: torch.Tensor | list[torch.Tensor]
            ) -> bool:
        """Write the draft's KV at ``batch``'s first-pass positions: replayed where a graph
        holds the step, else uncaptured (counted by the runner that would have taken it).
        False only when the step's target rows exceed the fc buffer (counted as
        ``target_rows``): the caller then runs its own uncaptured first pass."""
        aux = target_hidden if isinstance(target_hidden, list) else [target_hidden]
        hb = build_host_batch(self.prop.allocator, batch.first_pass, batch.token_ids)
        hb.rows = batch.hidden_rows
        runner = self._runner(hb.num_tokens, hb.max_query_len)
        if aux[0].shape[0] > self.hidden.shape[0]:
            runner.count_miss("target_rows")
            return False
        # EAGLE-3's fc over every target row of the step ([R, n*h_target] -> [R, h]) into the
        # row source (EAGLE-1: the final hidden, copied in); the graph gathers its rows.
        src = self.hidden[:aux[0].shape[0]]
        combined = self.prop.draft.combine_aux(aux, src)
        if combined.data_ptr() != src.data_ptr():
            src.copy_(combined)
        if runner.run_host(hb, None, extras={"hidden": src}) is None:  # a miss, counted:
            dev = self.prop.device  # the graph's body from device tensors, uncaptured
            ids, positions, meta = host_batch_to_device(hb, dev)
            self._body(LiveBatch(ids, positions, meta, extras={"hidden": src},
                                 rows=to_device(batch.hidden_rows, dev)))
        return True

    def stats(self) -> dict[str, Any]:
        return {r.name: r.stats() for r in self.runners}
