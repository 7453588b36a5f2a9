"""Our engine in the benchmark: one engine per variant, timed at each batch size.

A variant's engine is built once with ``max_num_seqs`` = the largest batch size (compiled
variants capture CUDA graphs for exactly the benchmarked batch sizes); batch B submits B prompts
at once (``--waves W``: W x B, at most B running, a finished request's slot refilled). Batch 1
runs the prompts one at a time. Greedy, EOS ignored: every request writes
``max_tokens`` tokens, so engines are compared on equal work.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from compiled_spec.bench.timing import PhaseTimer, Row, floor_ms, peak_gib, reset_peak, sync
from compiled_spec.engine.stats import counts_since
from compiled_spec.engine_args import COMPILE_FLAGS


@dataclass
class Variant:
    name: str
    draft: str | None
    compile: bool
    tree: tuple[int, int] | None = None  # EAGLE-2 draft tree: (topk, verified tokens incl. root)
    tree_depth: int | None = None  # its speculative_num_steps; None: the run's k
    policy: str = "always"  # speculation_policy (rows without "adaptive" draft every step)
    adaptive_k: tuple[int, ...] = ()  # with policy "adaptive": the smaller k it may verify
    early_propose: bool = True  # False: every proposal launched after the acceptance is read
    verify_ahead: bool | None = None  # EngineConfig.verify_ahead; None: the LLM's default
    defer_paused_first_pass: bool = True  # SpecConfig's (what an adaptive engine's pauses do)
    paused_flush_depth: int | None = None  # SpecConfig's; None: its default
    flush_behind_launch: bool = True  # SpecConfig's
    early_prompt_head: bool = True  # SpecConfig's
    cut_losing_probes: bool = False  # SpecConfig's
    probe_backoff: bool = True  # SpecConfig's
    # CompileConfig flags this variant sets over the run's own (bench --ab: one of a pair)
    flags: dict[str, bool] = field(default_factory=dict)


def _kv_blocks(prompts: list[list[int]], batch: int, max_tokens: int, k: int, page: int) -> int:
    """Exactly what the largest batch needs (so peak memory is the run's, not a default pool)."""
    longest = max(len(p) for p in prompts) + max_tokens + k + 1
    return batch * math.ceil(longest / page) + 2


def build_engine(v: Variant, kw: dict[str, Any], prompts: list[list[int]],
                 batch_sizes: list[int], max_tokens: int) -> tuple[Any, float]:
    """(LLM, start-up seconds)."""
    from compiled_spec import LLM
    from compiled_spec.compile import CompileConfig

    kw = dict(kw)
    given = {name: kw.pop(name, default) for name, default in COMPILE_FLAGS.items()}
    top = max(batch_sizes)
    kw.update(draft=v.draft, compile=v.compile, max_num_seqs=top)
    if v.compile:
        flags = given | v.flags
        # the layer / norm / draft fusions ride on the skinny GEMMs: an --ab skinny_gemm pair's
        # "off" has none of them
        flags["skinny_gemm_layer"] = (False if flags["skinny_gemm"] is False
                                      else given["skinny_gemm_layer"])
        flags["skinny_gemm_norms"] = given["skinny_gemm_norms"] and flags["skinny_gemm"] is True
        flags["skinny_gemm_draft"] = (flags["skinny_gemm_draft"]
                                      and flags["skinny_gemm"] is not False)
        kw["compile_config"] = CompileConfig(capture_batch_sizes=tuple(sorted(batch_sizes)),
                                             **flags)
    if v.draft is None:
        kw.pop("num_speculative_tokens", None)
    if v.tree is not None:
        kw.update(speculative_topk=v.tree[0], speculative_num_draft_tokens=v.tree[1])
        if v.tree_depth is not None:
            kw["speculative_num_steps"] = v.tree_depth
    if v.adaptive_k:
        kw["adaptive_k"] = v.adaptive_k
    if v.draft is not None:  # a row says its policy: the engine's default depends on the device
        kw["speculation_policy"] = v.policy
        kw["early_propose"] = v.early_propose
        kw["defer_paused_first_pass"] = v.defer_paused_first_pass
        kw["early_prompt_head"] = v.early_prompt_head
        if v.policy == "adaptive":
            kw["cut_losing_probes"] = v.cut_losing_probes
            kw["probe_backoff"] = v.probe_backoff
            kw["flush_behind_launch"] = v.flush_behind_launch
        if v.paused_flush_depth is not None:
            kw["paused_flush_depth"] = v.paused_flush_depth
    if v.verify_ahead is not None:
        kw["verify_ahead"] = v.verify_ahead
    # Size the KV pool from the prompts, so the reported peak memory is this run's need (a
    # tree writes every node's KV at its own slot past the last token).
    k = (v.tree[1] if v.tree else kw.get("num_speculative_tokens", 0)) if v.draft else 0
    kw["num_kv_blocks"] = _kv_blocks(prompts, top, max_tokens, k, kw.get("page_size", 16))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    return llm, time.perf_counter() - t0


def _quantiles_ms(seconds: list[float], qs: tuple[float, ...], digits: int) -> list[float]:
    """Quantiles (nearest rank below) of durations (step times, times to first token), in ms."""
    s = sorted(seconds)
    return [round(1e3 * s[int(q * (len(s) - 1))], digits) for q in qs]


@contextmanager
def running_at_most(llm: Any, n: int) -> Iterator[None]:
    """The scheduler runs at most ``n`` requests at once (``--waves``: the rest wait for a
    slot). The engine was built for the largest batch size, so every smaller one is captured."""
    sch = llm.engine.scheduler
    with sch.overriding(max_num_seqs=min(n, sch.cfg.max_num_seqs)):
        yield


class TimedTarget:
    """The runner's target with its call timed: every other attribute is the target's own.
    A bare timed function in its place hid ``GraphedTarget.logits_for`` (a method, which
    ``functools.wraps`` does not copy), so every benchmarked step read its logits out eagerly
    (an lm_head GEMM and an fp32 upcast) instead of taking the graph's."""

    def __init__(self, target: Any, timed: Any) -> None:
        self._target, self._timed = target, timed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # only for what the instance does not hold
        return getattr(self._target, name)


def time_engine(llm: Any, v: Variant, prompts: list[list[int]], batch_sizes: list[int],
                max_tokens: int, startup: float, waves: int = 1, temperature: float = 0.0
                ) -> tuple[list[Row], list[list[int]]]:
    """Rows for each batch size, plus the batch-1 outputs (for the identical-output column).
    ``waves`` > 1: batch b submits waves * b requests, at most b running (``running_at_most``).
    ``temperature`` > 0: every request samples (seed 0: vanilla's output is fixed, and every
    engine of ours must write it)."""
    runner = llm.engine.runner
    k = runner.k
    timer = PhaseTimer(llm.config.device)
    # Restored after timing: a second round (``bench_ours(rounds=...)``) wraps afresh, and
    # timers stacked from round to round would charge their host time to the later rounds.
    target = runner.target_fn
    props = [(o, o.__dict__.get("propose"))
             for o in (runner.proposer, getattr(runner, "early", None)) if o is not None]
    # Decode / verify steps only (prefill is not a per-token cost); propose as a whole. A tree
    # verify has num_draft_tokens query rows per request (and its tree mask).
    runner.target_fn = TimedTarget(target, timer.wrap(
        "verify", target, when=lambda ids, pos, meta, *a: (
            meta.max_query_len <= k + 1 or meta.tree_mask is not None)))
    if hasattr(target, "run_host"):  # CUDA graphs: the engine stages host batches itself
        runner.target_fn.run_host = timer.wrap(  # type: ignore[attr-defined]
            "verify", target.run_host, when=lambda hb, *a: hb.max_query_len <= k + 1)
    if hasattr(target, "run_tree_host"):  # draft trees with CUDA graphs: staged likewise
        runner.target_fn.run_tree_host = timer.wrap(  # type: ignore[attr-defined]
            "verify", target.run_tree_host)
    if runner.proposer is not None:
        runner.proposer.propose = timer.wrap("propose", runner.proposer.propose)
    if getattr(runner, "early", None) is not None:  # steps proposing before the D2H read
        runner.early.propose = timer.wrap("propose", runner.early.propose)
    try:
        return _timed_rows(llm, v, prompts, batch_sizes, max_tokens, startup, waves, timer,
                           temperature)
    finally:
        runner.target_fn = target
        for o, own in props:  # the instance's own attribute back, or none (the class's method)
            if own is None:
                del o.propose
            else:
                o.propose = own


def _timed_rows(llm: Any, v: Variant, prompts: list[list[int]], batch_sizes: list[int],
                max_tokens: int, startup: float, waves: int, timer: PhaseTimer,
                temperature: float) -> tuple[list[Row], list[list[int]]]:
    from compiled_spec import SamplingParams

    dev = llm.config.device
    seed = 0 if temperature > 0 else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                        ignore_eos=True)
    warm = SamplingParams(max_tokens=min(16, max_tokens), temperature=temperature, seed=seed,
                          ignore_eos=True)
    rows, batch1_out = [], []
    for b in batch_sizes:
        # Batch 1: every prompt in turn; batch b: b prompts at once (cycled when fewer exist).
        chosen = prompts if b == 1 else [prompts[i % len(prompts)] for i in range(b * waves)]
        # First-use costs off the clock: allocator growth, autotuning and, for compiled
        # engines off CUDA (no capture at start-up), compiling the shapes this batch meets.
        t0 = time.perf_counter()
        for p in (chosen[:2] if b == 1 else [chosen[:b]]):
            llm.generate(p, warm)
        if b == batch_sizes[0] and v.compile:
            startup += time.perf_counter() - t0  # compile-on-first-use is start-up cost
        timer.reset()
        reset_peak(dev)
        spec, es = llm.stats.spec, llm.stats
        d0, a0 = spec.num_drafting_steps, spec.num_accepted_tokens
        pp0 = list(spec.accepted_per_position)
        n0, s0, w0 = es.num_steps, es.step_s, es.host_wait_s
        hp0, php0 = dict(es.host_phase_s), dict(es.prompt_host_phase_s)
        vl0, vi0 = es.verify_launches, es.verify_launches_gpu_idle
        p0, ps0 = es.num_prefill_steps, es.prefill_step_s
        gc0, gcs0 = es.gc_full_collections, es.gc_full_s
        ep0 = es.early_propose.as_dict() if es.early_propose is not None else None
        va0 = es.verify_ahead.as_dict() if es.verify_ahead is not None else None
        df0 = (es.deferred_first_pass.as_dict() if es.deferred_first_pass is not None
               else None)
        sync(dev)
        load0, cpu0 = os.getloadavg()[0], time.process_time()
        t0 = time.perf_counter()
        if b == 1:
            outs = [llm.generate(p, sp)[0] for p in chosen]
        else:
            with running_at_most(llm, b):
                admit = llm.engine.scheduler.min_admit
                outs = llm.generate(chosen, sp)
        sync(dev)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        per_req = [1e3 * (o.metrics.finish_time - o.metrics.first_token_time)
                   / max(1, len(o.token_ids) - 1) for o in outs]
        steps = spec.num_drafting_steps - d0
        row = Row(engine=v.name, batch=b, ms_per_token=statistics.median(per_req),
                  tokens_per_s=sum(len(o.token_ids) for o in outs) / wall, startup_s=startup,
                  tau=(1 + (spec.num_accepted_tokens - a0) / steps) if steps else None,
                  propose_ms=timer.mean_ms("propose"), verify_ms=timer.mean_ms("verify"),
                  peak_mem_gib=peak_gib(dev))
        if steps:  # tau by draft position (a tree's: by depth), this row's steps alone
            pp = spec.accepted_per_position
            row.extra["acceptance_per_position"] = [
                round((c - (pp0[j] if j < len(pp0) else 0)) / steps, 4) for j, c in enumerate(pp)]
        if es.num_steps > n0:  # untraced: engine step time and the host's wait for the GPU in it
            row.extra["step_ms"] = round(1e3 * (es.step_s - s0) / (es.num_steps - n0), 4)
            row.extra["host_wait_ms"] = round(1e3 * (es.host_wait_s - w0) / (es.num_steps - n0), 4)
            if es.verify_launches > vl0:  # GPU only: host-bound (idle) or GPU-bound launches
                row.extra["gpu_idle_at_verify"] = round(
                    (es.verify_launches_gpu_idle - vi0) / (es.verify_launches - vl0), 4)
            # step_ms mixes the prompt steps (no CUDA graph) in; at batch b the b prompts come
            # in one or few steps, so the decode steps' own mean is given apart.
            n_pre, s_pre = es.num_prefill_steps - p0, es.prefill_step_s - ps0
            row.extra["steps"] = es.num_steps - n0
            row.extra["prefill_steps"] = n_pre
            row.extra["prefill_ms"] = round(1e3 * s_pre, 3)
            if n_pre:  # a few slow prompt steps (first launches per length?) or all of them
                row.extra["prefill_step_ms_p50_max"] = _quantiles_ms(
                    list(es.recent_prefill_step_s)[-n_pre:], (0.5, 1.0), 3)
            n_dec = es.num_steps - n0 - n_pre
            # where the steps' host time went, per decode step and per prompt step
            # (engine/host_clock.py)
            for key, now, then, n in (("host_phase_ms", es.host_phase_s, hp0, n_dec),
                                      ("prompt_host_phase_ms", es.prompt_host_phase_s, php0,
                                       n_pre)):
                if n > 0:
                    row.extra[key] = {p: round(1e3 * (s - then.get(p, 0.0)) / n, 4)
                                      for p, s in now.items()}
            if n_dec > 0:
                row.extra["decode_step_ms"] = round(1e3 * (es.step_s - s0 - s_pre) / n_dec, 4)
                row.extra["decode_step_ms_p50_p90_max"] = _quantiles_ms(
                    list(es.recent_decode_step_s)[-n_dec:], (0.5, 0.9, 1.0), 4)
        # Whether the host was shared: a host-bound engine whose process got less CPU than its
        # wall time while the load rose was slowed by other work, not by its own code (the
        # thirty-third session's chain row ran 3x slower in one process, every host phase alike).
        row.extra["host_cpu"] = {"process_cpu_per_wall": round(cpu / wall, 3),
                                 "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
                                 "cpus": os.cpu_count()}
        if b > 1 and waves > 1:
            row.extra["waves"], row.extra["requests"] = waves, len(outs)
            row.extra["min_admit"] = admit
            # Bulk admission trades time to first token for fewer prompt steps: both shown.
            row.extra["ttft_ms_p50_p90"] = _quantiles_ms(
                [o.metrics.time_to_first_token for o in outs], (0.5, 0.9), 2)
        if es.gc_full_collections > gc0:  # full GC pauses inside the timed steps
            row.extra["gc_full"] = {"count": es.gc_full_collections - gc0,
                                    "ms": round(1e3 * (es.gc_full_s - gcs0), 2)}
        if ep0 is not None:  # steps that proposed before / after the acceptance was read
            row.extra["early_propose"] = counts_since(ep0, es.early_propose.as_dict())
        if va0 is not None and es.verify_ahead.launched > va0["launched"]:
            row.extra["verify_ahead"] = counts_since(va0, es.verify_ahead.as_dict())
        if df0 is not None and es.deferred_first_pass.deferred_steps > df0["deferred_steps"]:
            row.extra["deferred_first_pass"] = counts_since(df0, es.deferred_first_pass.as_dict())
        if llm.stats.policy is not None:  # what the adaptive policy chose at this batch
            from compiled_spec.spec.policy import bucket_of

            row.extra["policy"] = llm.stats.policy.summary().get(bucket_of(b))
        if b == 1:
            fl = floor_ms(llm.engine.model, dev)
            row.floor_ratio = row.ms_per_token / fl if fl else None
            batch1_out = [o.token_ids for o in outs]
        if llm.compiled_active:
            g = llm.compile_stats.get("cuda_graphs", {})
            row.extra["steps_without_graph"] = g.get("without_graph", g.get("off"))
            draws = g.get("components", {}).get("sample_draw", {}).get("graph_replays")
            if draws:  # sampled steps' draws by graph (engine/sample_graph.py), engine total
                row.extra["sample_draw_replays"] = draws
            # No silent fallback in a benchmark either: sizes captured around a compile
            # failure (their glue eager), and shapes run eagerly after one.
            failed = {n: c["capture_failures"] for n, c in g.get("components", {}).items()
                      if c.get("capture_failures")}
            if failed:
                row.extra["capture_failures"] = failed
            if "compile_failures" in llm.compile_stats:
                row.extra["compile_failures"] = llm.compile_stats["compile_failures"]
            # Compiled graphs so far per component: growth across rows means recompiles (a
            # prefill of a new shape class recompiles; those seconds land in tokens/s).
            row.extra["compiled_graphs"] = {n: c["graphs"] for n, c in llm.compile_stats.items()
                                            if isinstance(c, dict) and "graphs" in c}
            if "skinny_gemm" in llm.compile_stats:  # the fused layer, as the engine decided it
                row.extra["skinny_gemm"] = llm.compile_stats["skinny_gemm"]
            if "pdl" in llm.compile_stats:  # programmatic dependent launch, as decided
                row.extra["pdl"] = llm.compile_stats["pdl"]
            if "pdl_draft" in llm.compile_stats:
                row.extra["pdl_draft"] = llm.compile_stats["pdl_draft"]
            if "compiled_after_startup" in llm.compile_stats:  # in a request: start-up missed it
                row.extra["compiled_after_startup"] = llm.compile_stats["compiled_after_startup"]
            # Where start-up went, and whether the persistent cache served it: on the H200 one
            # target graph took 35-52 s to capture on a machine whose cache should have held it
            # (results/2026-12-01_h200_session8/), so the row says hits and misses itself.
            if b == batch_sizes[0]:
                row.extra["startup_split_s"] = {k: round(s, 2) for k, s in llm.startup_s.items()}
                row.extra["startup_detail_s"] = {k: round(s, 2)
                                                 for k, s in llm.startup_detail_s.items()}
                row.extra["compile_cache"] = llm.compile_cache
        rows.append(row)
    return rows, batch1_out
