"""CUDA graphs in the engine: which callables get captured, with which static buffers, and how
each engine step is routed to a replay (or, counted, to the compiled function without one).

Four components share one graph memory pool (``capture.GraphRegistry``):

* ``target_decode``: the target over one token per request (vanilla decoding; T = n).
* ``target_verify``: the target over [last token, k drafts] per request (T = n * (k + 1)); a
  batch whose requests verify fewer drafts pads into it (q_len <= k + 1 fits the graph's grid).
* ``draft_first_pass``: the draft over each request's accepted positions (<= k + 1 tokens each),
  shapes as verify. EAGLE-3's fc runs eagerly *before* the replay, over the target's aux states:
  the captured part is the same compiled ``draft.forward`` the later steps use, so no graph
  depends on the aux width or the first pass's token count (seeds/003).
* ``draft_loop``: draft steps 2..k as ONE graph (the proposer's ``run_loop``, k - 1 unrolled
  steps, metadata for all steps precomputed into [k-1, B] buffers).

Prefill steps (any request with more than k + 1 query tokens) are never captured; they run the
compiled function directly and are counted as ``prefill``. Every other miss (batch above the
largest captured size, context above the largest bucket, a failed capture, the CPU) is counted by
its ``GraphRunner`` under its reason, so ``stats()`` always says how each step ran.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from capture import (CapturePolicy, GraphRegistry, GraphRunner, LiveBatch, StaticBuffers,
                     decode_sizes, draft_step_sizes, verify_sizes)
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.engine.model_runner import ModelRunner

TargetFn = Callable[..., Any]  # (input_ids, positions, meta, aux_layer_ids) -> (hidden, aux)


class GraphedTarget:
    """Drop-in for ``ModelRunner.target_fn``: decode graph, verify graph, or (prefill) none."""

    def __init__(self, fn: TargetFn, decode: GraphRunner, verify: GraphRunner | None,
                 verify_query_len: int) -> None:
        self.fn, self.decode, self.verify = fn, decode, verify
        self.verify_query_len = verify_query_len
        self.prefill_calls = 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 aux_layer_ids: tuple[int, ...] = ()) -> Any:
        live = LiveBatch(input_ids, positions, meta)
        if meta.max_query_len == 1:
            return self.decode.run(live)
        if self.verify is not None and meta.max_query_len <= self.verify_query_len:
            return self.verify.run(live)
        self.prefill_calls += 1
        return self.fn(input_ids, positions, meta, aux_layer_ids)


class GraphedFirstPass:
    """Drop-in for ``EagleProposer.first_pass_fn``: eager fc, then the captured draft forward."""

    def __init__(self, combine_aux: Callable[[list[torch.Tensor]], torch.Tensor],
                 step_fn: Callable[..., Any], runner: GraphRunner, query_len: int) -> None:
        self.combine_aux, self.step_fn, self.runner = combine_aux, step_fn, runner
        self.query_len = query_len
        self.prefill_calls = 0

    def __call__(self, aux: list[torch.Tensor], input_ids: torch.Tensor, positions: torch.Tensor,
                 attn_metas: dict[str, AttentionMetadata]) -> Any:
        hidden = self.combine_aux(aux)  # [T, h]: EAGLE-3's fc, eager, outside every graph
        meta = next(iter(attn_metas.values()))  # all layers share the slots (see proposer)
        if meta.max_query_len > self.query_len:
            self.prefill_calls += 1
            return self.step_fn(input_ids, hidden, positions, attn_metas)
        return self.runner.run(LiveBatch(input_ids, positions, meta, {"hidden": hidden}))


class EngineGraphs:
    """Registers, captures (dummy runs at start-up) and routes the engine's CUDA graphs."""

    def __init__(self, runner: ModelRunner, target_fn: TargetFn, policy: CapturePolicy,
                 page_size: int, strict: bool = False,
                 runner_cls: type[GraphRunner] = GraphRunner) -> None:
        device = runner.device
        self.policy = policy
        self.capture_s: float | None = None
        self.registry = GraphRegistry(device, strict=strict)
        k = policy.num_speculative_tokens
        max_seqs = policy.batch_sizes[-1]
        max_blocks = math.ceil(policy.max_model_len / page_size)
        aux_ids = runner.aux_layer_ids
        buckets = dict(seq_len_buckets=policy.seq_len_buckets)

        def reg(name: str, fn: Callable[[LiveBatch], Any], sizes: list[int],
                bufs: StaticBuffers, **kw: Any) -> GraphRunner:
            # Outputs are cloned: the next replay of any graph in the pool may reuse their
            # memory, and the engine keeps target states until propose, drafts until verify.
            r = runner_cls(name, fn, sizes, bufs, pool=self.registry.pool, strict=strict,
                           clone_outputs=True, **buckets, **kw)
            self.registry.runners[name] = r
            return r

        top_tokens = max_seqs * (k + 1)
        tbufs = StaticBuffers(top_tokens, max_seqs, max_blocks, device)
        target_graph_fn = lambda b: target_fn(b.input_ids, b.positions, b.meta, aux_ids)  # noqa: E731
        decode = reg("target_decode", target_graph_fn, decode_sizes(policy), tbufs)
        verify = reg("target_verify", target_graph_fn, verify_sizes(policy), tbufs,
                     query_len=k + 1) if k > 0 else None
        self.target = GraphedTarget(target_fn, decode, verify, k + 1)
        self.first_pass: GraphedFirstPass | None = None
        self.loop: GraphRunner | None = None
        prop = runner.proposer
        if prop is None:
            return
        h, dtype = prop.draft.config.hidden_size, runner.model.lm_head.weight.dtype
        step_fn = prop.step_fn
        names = prop.layer_names
        fbufs = StaticBuffers(top_tokens, max_seqs, max_blocks, device,
                              token_extras={"hidden": ((h,), dtype)})
        first = reg("draft_first_pass",
                    lambda b: step_fn(b.input_ids, b.extras["hidden"], b.positions,
                                      {n: b.meta for n in names}),
                    verify_sizes(policy), fbufs, query_len=k + 1)
        self.first_pass = GraphedFirstPass(prop.draft.combine_aux, step_fn, first, k + 1)
        if k > 1:
            lbufs = StaticBuffers(max_seqs, max_seqs, max_blocks, device, num_steps=k - 1,
                                  seq_extras={"feed": ((h,), dtype),
                                              "temperature": ((), torch.float32),
                                              "seeds": ((), torch.int64)})
            self.loop = reg("draft_loop", prop.run_loop, draft_step_sizes(policy), lbufs,
                            output_rows="seqs")

    @property
    def required(self) -> list[str]:
        """Components that must have graphs: every registered one."""
        return list(self.registry.runners)

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

    def stats(self) -> dict[str, Any]:
        per = self.registry.stats()
        per["target_decode"]["prefill_calls"] = self.target.prefill_calls
        if self.first_pass is not None:
            per["draft_first_pass"]["prefill_calls"] = self.first_pass.prefill_calls
        return {"capture_s": self.capture_s, "components": per,
                "replayed": sum(r["graph_replays"] for r in per.values()),
                "padded_rows": sum(r["padded_rows"] for r in per.values()),
                "without_graph": {name: r["fallback_reasons"] for name, r in per.items()
                                  if r["eager_fallbacks"]}}
