"""CUDA graphs in the engine: which callables get captured, with which static buffers, and how
each engine step is routed to a replay (or, counted, to the compiled function without one).

Three components share one graph memory pool (``capture.GraphRegistry``):

* ``target_decode``: the target over one token per request (vanilla decoding; T = n).
* ``target_verify``: the target over [last token, k drafts] per request (T = n * (k + 1)); a
  batch whose requests verify fewer drafts pads into it (q_len <= k + 1 fits the graph's grid).
  ``target_verify_k<w>``: the same for w < k drafts, where an adaptive policy may shrink k
  (``SpecConfig.adaptive_k``).
* ``draft_propose`` (``propose_graph.ProposeGraphs``): the whole propose as one graph per batch
  size: the first pass over each request's accepted positions (<= k + 1 each), the first draft,
  and the k - 1 step loop. EAGLE-3's fc runs eagerly *before* the replay, over the target's aux
  states, so no graph depends on the aux width or the first pass's token count (seeds/003).

* ``draft_prefill_<T>`` (``draft_prefill_graph.DraftPrefillGraphs``): the leading first-pass
  positions of a prompt, the ones before the propose graph's k + 1 (a tree's: before its
  first-pass graph's rows), as varlen graphs of T tokens (the target's prompt-graph sizes);
  and a paused prompt step's whole first pass.

Draft-tree engines register ``target_tree_verify``, ``tree_draft_first_pass`` and
``tree_draft_expand`` (``engine.tree_graphs``) instead of ``target_verify`` / ``draft_propose``,
and with early propose on ``tree_draft_early`` (``engine.early_tree_graph``).

* ``target_prefill_<Q>``: one sequence's prompt step, padded to Q query tokens
  (``capture.policy.prefill_sizes``; ``CompileConfig.prefill_graph_tokens``), its rows past the
  prompt inert.
* ``target_prefill_mixed``: a prompt step of several sequences (prompts, and the requests
  decoding beside them), a varlen graph per token count (``capture.policy.mixed_sizes``;
  ``CompileConfig.mixed_graph_tokens``): its tokens padded to the smallest count that holds
  them, its sequences to max_num_seqs, each of at most the largest prefill Q tokens. A step it
  does not hold (a longer prompt, more tokens) runs compiled, counted under its reason.

Other prompt steps (one sequence above the largest Q, or no graphs for them) run the compiled
function directly and are counted as ``prefill_calls``. Every other miss (batch above the
largest captured size, context above the largest bucket, a failed capture, the CPU) is counted by
its ``GraphRunner`` under its reason, so ``stats()`` always says how each step ran.
"""
from __future__ import annotations

import functools
import math
import time
from typing import Any, Callable

import torch

from capture import (CapturePolicy, GraphRegistry, GraphRunner, LiveBatch, StaticBuffers,
                     decode_sizes, verify_sizes)
from capture.emulate import EmulatedGraphRunner
from capture.host_stage import HostBatch
from capture.pad import as_static
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.engine.batch import host_batch_to_device
from compiled_spec.engine.draft_prefill_graph import NAME as DRAFT_PREFILL
from compiled_spec.engine.draft_prefill_graph import DraftPrefillGraphs
from compiled_spec.engine.model_runner import ModelRunner
from compiled_spec.engine.early_propose_graph import EarlyProposeGraphs
from compiled_spec.engine.early_tree_graph import EarlyTreeGraphs
from compiled_spec.engine.propose_graph import ProposeGraphs
from compiled_spec.engine.sample_graph import SampleGraphs
from compiled_spec.engine.sync_graph import SyncGraphs
from compiled_spec.engine.tree_graphs import TreeProposeGraphs, register_tree_verify, tree_live

TargetFn = Callable[..., Any]  # (input_ids, positions, meta, aux_layer_ids) -> (hidden, aux)
PREFILL = "target_prefill"  # component names: target_prefill_<query length>
MIXED = f"{PREFILL}_mixed"  # prompt steps of several sequences


def with_logits(out: tuple[torch.Tensor, Any], lm_head: Callable[[torch.Tensor], torch.Tensor]
                ) -> tuple[torch.Tensor, Any, torch.Tensor]:
    """(hidden [T, h], aux) -> (hidden, aux, lm_head(hidden) [T, V] in the model dtype).
    EAGLE-3's aux states leave the graph concatenated ([[T, 3 * h]]), as its eager fc reads
    them (``EagleDraft.combine_aux``): the concatenation is a kernel in the graph instead of
    an eager launch on every step's host path."""
    hidden, aux = out
    if isinstance(aux, (list, tuple)) and len(aux) > 1:
        aux = [torch.cat(list(aux), dim=-1)]
    return hidden, aux, lm_head(hidden)


def by_rows(wide: TargetFn, narrow: TargetFn, max_rows: int) -> TargetFn:
    """The target as two compiled callables, picked by the call's rows (its input_ids): each
    graph captures the one its padded size picks, so the choice costs a replay nothing."""
    def target(input_ids: torch.Tensor, *args: Any) -> Any:  # input_ids [T]
        return (narrow if input_ids.shape[0] <= max_rows else wide)(input_ids, *args)
    return target


class GraphedTarget:
    """Drop-in for ``ModelRunner.target_fn``: decode, verify or tree-verify graph, or (prefill)
    none. Decode, verify and tree-verify graphs also compute the logits of every row:
    ``logits_for`` hands them to the step that reads this replay's hidden states."""

    def __init__(self, fn: TargetFn, decode: GraphRunner, verify: GraphRunner | None,
                 verify_query_len: int, tree: GraphRunner | None = None,
                 single_via_verify: bool = False, prefill: list[GraphRunner] | None = None,
                 mixed: GraphRunner | None = None, narrow: list[GraphRunner] | None = None
                 ) -> None:
        self.fn, self.decode, self.verify, self.tree = fn, decode, verify, tree
        self.verify_query_len = verify_query_len
        # Verify graphs of fewer rows per request (k shrunk), by query length ascending.
        self.narrow = sorted(narrow or [], key=lambda r: r.query_len)
        # One request decoding replays the batch-1 verify graph (capture.policy.decode_sizes).
        self.single_via_verify = single_via_verify and verify is not None
        # One-sequence prompt steps, by query length ascending (capture.policy.prefill_sizes).
        self.prefill = sorted(prefill or [], key=lambda r: r.query_len)
        self.mixed = mixed  # prompt steps of several sequences (a varlen graph)
        self.prefill_calls = 0  # prompt steps run without a graph
        # (hidden, logits) of the last decode / verify replay that computed logits
        self._logits: tuple[torch.Tensor, torch.Tensor] | None = None

    def _split(self, out: Any) -> Any:
        """A replay's (hidden, aux[, logits]) -> (hidden, aux), its logits kept for
        ``logits_for``."""
        if len(out) == 3:
            self._logits = (out[0], out[2])
            return out[0], out[1]
        return out

    def logits_for(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[T, V] (model dtype) the last replay's logits when ``hidden`` is that replay's hidden
        output (graph memory, valid until the next replay: read them right away), else None."""
        kept, self._logits = self._logits, None
        return kept[1] if kept is not None and kept[0] is hidden else None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 aux_layer_ids: tuple[int, ...] = ()) -> Any:
        if meta.tree_mask is not None:  # never a causal graph: they would ignore the mask
            if self.tree is None:
                raise RuntimeError("tree attention reached an engine without a tree-verify graph")
            return self._split(self.tree.run(tree_live(input_ids, positions, meta)))
        runner = self._causal_runner(meta.max_query_len, meta.block_tables.shape[0])
        if runner is not None:
            return self._split(runner.run(LiveBatch(input_ids, positions, meta)))
        return self._without_graph(LiveBatch(input_ids, positions, meta), aux_layer_ids)

    def _without_graph(self, live: LiveBatch, aux_layer_ids: tuple[int, ...]) -> Any:
        """A causal step no graph holds, run compiled on inputs laid out as the graphs' own
        (``capture.pad.as_static``): the compiled target guards on its inputs' dispatch keys
        and view bases, and host-built tensors (inference tensors, other bases) compiled it a
        second time (EAGLE chain engines: ``compiled_graphs`` target 2 on the H100)."""
        static = as_static(live)
        return self.fn(static.input_ids, static.positions, static.meta, aux_layer_ids)

    def _causal_runner(self, max_query_len: int, num_seqs: int) -> GraphRunner | None:
        """Decode (one query token), verify (up to k + 1; the smallest narrow verify graph that
        holds the step where k shrank), one sequence's prompt step (the
        smallest prefill graph that holds it), or several sequences' (the varlen graph: its
        lookup pads the step, or counts why not); None, counted, for any other prompt step."""
        if max_query_len == 1 and not (self.single_via_verify and num_seqs == 1):
            return self.decode
        for r in self.narrow:
            if max_query_len <= r.query_len:
                return r
        if self.verify is not None and max_query_len <= self.verify_query_len:
            return self.verify
        if num_seqs == 1:
            for r in self.prefill:
                if r.query_len >= max_query_len:
                    return r
        elif self.mixed is not None:
            return self.mixed
        self.prefill_calls += 1
        return None

    def run_tree_host(self, hb: HostBatch, drafts_flat: torch.Tensor,
                      extras: dict[str, torch.Tensor]) -> Any:
        """A tree verification from host lists (positions = the roots', ``extras`` = depth and
        tree_mask, see ``engine.tree_graphs``), staged into the tree-verify graph's buffers; a
        batch no graph fits (counted) runs the graph's body compiled from device tensors."""
        if self.tree is None:
            raise RuntimeError("tree attention reached an engine without a tree-verify graph")
        out = self.tree.run_host(hb, drafts_flat, extras)
        if out is not None:
            return self._split(out)
        input_ids, positions, meta = host_batch_to_device(hb, self.decode.buffers.device,
                                                          drafts_flat)
        return self._split(self.tree.fn(LiveBatch(input_ids, positions, meta, extras=extras)))

    def run_host(self, hb: HostBatch, drafts_flat: torch.Tensor | None,
                 aux_layer_ids: tuple[int, ...] = ()) -> Any:
        """The engine's causal steps from a host-built batch: decode / verify replay with the
        inputs staged in two copies; anything without a graph (prefill, or a counted miss)
        gets device tensors built here and runs compiled."""
        runner = self._causal_runner(hb.max_query_len, hb.num_seqs)
        out = None if runner is None else runner.run_host(hb, drafts_flat)
        if out is not None:
            return self._split(out)
        input_ids, positions, meta = host_batch_to_device(hb, self.decode.buffers.device,
                                                          drafts_flat)
        return self._without_graph(LiveBatch(input_ids, positions, meta), aux_layer_ids)


class EngineGraphs:
    """Registers, captures (dummy runs at start-up) and routes the engine's CUDA graphs."""

    def __init__(self, runner: ModelRunner, target_fn: TargetFn, policy: CapturePolicy,
                 page_size: int, strict: bool = False, emulate: bool = False,
                 single_decode: bool = False, sample_graphs: bool = True) -> None:
        """``emulate``: CPU stand-ins for CUDA graphs (``capture.emulate``), for tests.
        ``single_decode``: a chain engine captures a one-request decode graph too (else such
        steps replay the batch-1 verify graph, ``capture.policy.decode_sizes``): an engine whose
        paused steps decode at batch 1 (on the H100, forty-third session, such steps took 0.80 ms
        at the median against vanilla's 0.76, their target call 0.78 against 0.75 ms)."""
        device = runner.device
        self.policy = policy
        self.capture_s: float | None = None
        self.registry = GraphRegistry(device, strict=strict,
                                      runner_cls=EmulatedGraphRunner if emulate else None)
        tree = getattr(runner, "tree", None)  # TreeConfig of a draft-tree engine
        k = 0 if tree is not None else policy.num_speculative_tokens  # trees verify no chains
        max_seqs = policy.batch_sizes[-1]
        max_blocks = math.ceil(policy.max_model_len / page_size)
        aux_ids = runner.aux_layer_ids
        # Outputs are returned as graph memory, valid until the next replay of any graph in the
        # pool. Every reader consumes (or copies) them before that: logits right away, the
        # target's states in the next propose's eager gather and fc (before its replay), the
        # first pass's last rows before the expansion, and the tree runner copies the trees it
        # reads after its verify before replaying it. No copy out of graph memory: one launch
        # per output saved per step. The CPU emulation poisons stale outputs (capture.emulate),
        # so the tests hold every reader to this.
        reg = functools.partial(self.registry.register, seq_len_buckets=policy.seq_len_buckets)

        top_tokens = max_seqs * (k + 1)
        tbufs = StaticBuffers(top_tokens, max_seqs, max_blocks, device)
        target_graph_fn = lambda b: target_fn(b.input_ids, b.positions, b.meta, aux_ids)  # noqa: E731
        # Decode, verify and tree-verify steps want logits for every row: the lm_head is
        # captured with them (one launch fewer on the step's host path, the bf16 logits in
        # the graph's pool instead of a fresh allocation each step). Tensor-parallel readouts
        # gather across ranks: they stay eager.
        lm_head = runner.model.readout if getattr(runner.model, "tp", None) is None else None
        step_graph_fn = target_graph_fn if lm_head is None else (
            lambda b: with_logits(target_graph_fn(b), lm_head))
        via_verify = k > 0 and not single_decode
        decode = reg("target_decode", step_graph_fn, decode_sizes(policy, via_verify), tbufs)
        verify = reg("target_verify", step_graph_fn, verify_sizes(policy), tbufs,
                     query_len=k + 1) if k > 0 else None
        # Verifying fewer drafts than k (the adaptive policy's shrunk k): graphs of w + 1 rows
        # per request, which a k + 1-row graph would pad back to its full cost.
        narrow = [reg(f"target_verify_k{w}", step_graph_fn, verify_sizes(policy, w), tbufs,
                      query_len=w + 1) for w in policy.verify_widths] if k > 0 else []
        tree_target = target_fn if lm_head is None else (
            lambda *a: with_logits(target_fn(*a), lm_head))  # the tree graph's logits too
        tree_verify = None if tree is None else register_tree_verify(
            reg, tree_target, tree, policy.batch_sizes, max_blocks, device, aux_ids)
        # One sequence's prompt step, padded to a captured query length (its own buffers: the
        # decode / verify ones hold max_seqs * (k + 1) tokens).
        prefill = []
        if policy.prefill_sizes:
            # Two sequences, the second always padding (no tokens): with one, Dynamo
            # specializes a 0/1 value of the metadata and the whole target compiles once more
            # for these graphs; with two they share the decode graphs' compile. Size-oblivious
            # symbols do not cover it: the query starts' storage offset in the packed buffer
            # (below 2 with one sequence) is what it guards on then (twenty-eighth session).
            pbufs = StaticBuffers(policy.prefill_sizes[-1], 2, max_blocks, device)
            # a prompt of q tokens has a context of at least q: buckets below q hold none
            prefill = [reg(f"{PREFILL}_{q}", target_graph_fn, [q], pbufs, query_len=q, seqs=2,
                           seq_len_buckets=tuple(b for b in policy.seq_len_buckets if b >= q))
                       for q in policy.prefill_sizes if q <= policy.seq_len_buckets[-1]]
        # Several sequences' prompt steps: one varlen graph per token count, padded to max_seqs
        # sequences (their own buffers, as the prefill graphs').
        mixed = None
        mixed_buckets = tuple(b for b in policy.seq_len_buckets if b >= policy.mixed_query_len)
        if policy.mixed_sizes and max_seqs > 1 and mixed_buckets:
            mbufs = StaticBuffers(policy.mixed_sizes[-1], max_seqs, max_blocks, device)
            mixed = reg(MIXED, target_graph_fn, list(policy.mixed_sizes), mbufs,
                        query_len=policy.mixed_query_len, seqs=max_seqs,
                        seq_len_buckets=mixed_buckets)
        self.target = GraphedTarget(target_fn, decode, verify, k + 1, tree_verify,
                                    single_via_verify=via_verify, prefill=prefill, mixed=mixed,
                                    narrow=narrow)
        # A sampled step's draws (engine/sample_graph.py): a decode step's one row per
        # request, a chain step's k + 1 (the early proposal's acceptance input), a draft
        # tree's one per node
        self.sample: SampleGraphs | None = None
        if sample_graphs:
            width = k + 1 if tree is None else tree.num_draft_tokens
            self.sample = SampleGraphs(policy.batch_sizes, (1, width),
                                       runner.model.config.vocab_size, device, emulate, strict)
            self.registry.runners[SampleGraphs.name] = self.sample  # type: ignore[assignment]
        self.propose: ProposeGraphs | TreeProposeGraphs | None = None
        self.propose_early: EarlyProposeGraphs | EarlyTreeGraphs | None = None
        self.sync: SyncGraphs | None = None  # the first pass alone (engines that may pause)
        self.draft_prefill: DraftPrefillGraphs | None = None  # a prompt's first pass
        prop = runner.proposer
        if prop is None:
            return
        dtype = runner.model.lm_head.weight.dtype
        if tree is not None:
            self.propose = TreeProposeGraphs(reg, prop, policy.batch_sizes, max_blocks, dtype)
            # (a prompt's first pass before the tree's own first-pass graph: the chain's prompt
            # graphs, on the proposer the tree proposer wraps)
            self.draft_prefill = DraftPrefillGraphs.for_policy(
                self.registry.register, prop.base, policy, mixed is not None, max_blocks,
                tree.num_draft_tokens, dtype, tree=True)
            if runner.early is not None and runner.early.enabled:  # engine/early_tree.py
                self.propose_early = EarlyTreeGraphs(
                    self.propose, prop, runner.allocator, policy.batch_sizes, max_blocks,
                    policy.seq_len_buckets[-1], runner.move_kv, pool=self.registry.pool,
                    emulate=emulate, strict=strict,
                    verify_extras=None if tree_verify is None else tree_verify.buffers.extras)
                self.registry.runners[EarlyTreeGraphs.name] = self.propose_early  # type: ignore
            return
        # One graph per batch size, at the largest bucket: the draft's attention is one layer,
        # so shorter buckets would buy little for their extra captures.
        self.propose = ProposeGraphs(prop, runner.allocator, policy.batch_sizes, max_blocks,
                                     policy.seq_len_buckets[-1], dtype,
                                     pool=self.registry.pool, emulate=emulate, strict=strict)
        self.registry.runners[ProposeGraphs.name] = self.propose  # type: ignore[assignment]
        self.draft_prefill = DraftPrefillGraphs.for_policy(
            self.registry.register, prop, policy, mixed is not None, max_blocks, k + 1, dtype)
        if prop.capture_sync:  # paused steps and their deferred first passes
            self.sync = SyncGraphs(prop, runner.allocator, policy.batch_sizes,
                                   prop.sync_rows or k + 1, max_blocks,
                                   policy.seq_len_buckets[-1], dtype, emulate=emulate,
                                   strict=strict)
            self.registry.runners[SyncGraphs.name] = self.sync  # type: ignore[assignment]
        # Early propose (engine/early_propose.py): its own graphs, captured only when it is on.
        if runner.early is not None and runner.early.enabled:
            self.propose_early = EarlyProposeGraphs(self.propose)
            self.registry.runners[EarlyProposeGraphs.name] = self.propose_early  # type: ignore

    @property
    def required(self) -> list[str]:
        """Components that must have graphs: every registered one with sizes to capture (a
        chain engine of batch size 1 has no decode graph: the verify graph serves it). Prompt
        steps ran without graphs before they had any: a failed prefill capture (the target's or
        the draft's) is recorded and its steps run compiled, counted, but start-up goes on."""
        return [name for name, r in self.registry.runners.items()
                if r.sizes and not name.startswith((PREFILL, DRAFT_PREFILL, SampleGraphs.name))]

    def capture(self) -> float:
        """Dummy runs + capture of every component; raises ``CaptureError`` when a component
        (the draft included) ends up with no graph at all on CUDA. Returns the seconds taken."""
        t0 = time.perf_counter()
        self.registry.capture_all()
        if self.registry.device.type == "cuda" or all(r.enabled for r in
                                                      self.registry.runners.values()):
            self.registry.assert_captured(*self.required)
        self.capture_s = time.perf_counter() - t0
        return self.capture_s

    def reset_counts(self) -> None:
        """Replays, padded rows and fallbacks back to zero (after start-up's dummy requests)."""
        for r in self.registry.runners.values():
            r.graph_replays = r.padded_rows = r.eager_fallbacks = 0
            r.fallback_reasons = {}
        self.target.prefill_calls = 0

    def stats(self) -> dict[str, Any]:
        per = self.registry.stats()
        per["target_decode"]["prefill_calls"] = self.target.prefill_calls
        return {"capture_s": self.capture_s, "components": per,
                "replayed": sum(r["graph_replays"] for r in per.values()),
                "padded_rows": sum(r["padded_rows"] for r in per.values()),
                "without_graph": {name: r["fallback_reasons"] for name, r in per.items()
                                  if r["eager_fallbacks"]}}
