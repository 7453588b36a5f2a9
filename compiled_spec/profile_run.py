"""``compiled-spec profile``: a torch.profiler trace of generation, readable in TensorBoard
(torch-tb-profiler), with the propose / verify latencies read back from the trace itself
(``profile.phase_latencies``).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from compiled_spec.profile import print_phases, trace_calls

if TYPE_CHECKING:
    from compiled_spec import LLM


def host_profile(run: Callable[[], object], llm: "LLM", rows: int,
                 count: Callable[[], int] | None = None, label: str = "engine steps",
                 by: tuple[str, ...] = ("own",)) -> None:
    """Run ``run`` under cProfile and print the ``rows`` functions with the most own time, per
    engine step: where the host's time goes in a step whose GPU part is known from the trace.
    ``count``: what to divide by instead (e.g. the engine's prompt-step counter), named by
    ``label``; ``by``: a table per order, "own" and / or "cumulative" time."""
    count = count or (lambda: llm.stats.num_steps)
    prof = cProfile.Profile()
    steps0 = count()
    prof.enable()
    run()
    prof.disable()
    steps = max(count() - steps0, 1)
    st = pstats.Stats(prof)
    total = sum(v[2] for v in st.stats.values())  # own time of every function
    print(f"cprofile: {steps} {label}, {1e3 * total / steps:.3f} ms of host time per step "
          f"(under cProfile)")
    for order in by:
        key = {"own": 2, "cumulative": 3}[order]
        if len(by) > 1:
            print(f"-- by {order} time")
        top = sorted(st.stats.items(), key=lambda kv: kv[1][key], reverse=True)[:rows]
        print(f"{'own us/step':>12} {'cum us/step':>12} {'calls/step':>10}  function")
        for (file, line, name), (_, ncalls, own, cum, _) in top:
            print(f"{1e6 * own / steps:12.1f} {1e6 * cum / steps:12.1f} {ncalls / steps:10.1f}  "
                  f"{name} ({Path(file).name}:{line})")


def run_profile(a: argparse.Namespace) -> int:
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.bench import load_mt_bench, mt_bench_prompts
    from compiled_spec.engine_args import engine_kwargs

    llm = LLM(**engine_kwargs(a))
    texts = load_mt_bench(a.prompts, a.num_prompts)
    prompts = mt_bench_prompts(llm, texts)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    batch = getattr(a, "batch", 1)
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"--batch {batch!r}: must be a positive integer")
    # Warm-up at the profiled batch size: a first call of a new shape may compile (Dynamo) and
    # the trace would show compilation instead of steps.
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    llm.generate(prompts[:batch] if batch > 1 else prompts[0], warm)
    if batch > 1:  # the step cost without the profiler's own overhead, for comparison
        steps0, t0 = llm.stats.num_steps, time.perf_counter()
        phases0, pre0 = dict(llm.stats.host_phase_s), llm.stats.num_prefill_steps
        llm.generate(prompts[:batch], sp)
        secs, steps = time.perf_counter() - t0, llm.stats.num_steps - steps0
        print(f"untraced: batch {batch}, {steps} engine steps in {secs:.2f} s "
              f"({1e3 * secs / max(steps, 1):.2f} ms each)")
        decode = max(steps - (llm.stats.num_prefill_steps - pre0), 1)
        print("host ms per decode step by phase: " + ", ".join(
            f"{p} {1e3 * (s - phases0.get(p, 0.0)) / decode:.3f}"
            for p, s in llm.stats.host_phase_s.items()))
    rows = getattr(a, "cprofile", 0)
    if rows:  # the host's share by Python function (cProfile slows Python; shares, not times)
        host_profile(lambda: llm.generate(prompts[:batch] if batch > 1 else prompts[0], sp),
                     llm, rows)
    def run() -> None:
        for i in range(0, len(prompts), batch):  # --batch requests per call (default one)
            llm.generate(prompts[i:i + batch] if batch > 1 else prompts[i], sp)

    trace = trace_calls(llm, run, Path(a.out_dir) / time.strftime("%Y%m%d-%H%M%S"),
                        getattr(a, "kernel_table", 0))
    print(f"trace: {trace}\nview:  tensorboard --logdir {a.out_dir}   (pip install torch-tb-profiler)")
    lat = print_phases(trace)
    if "propose" not in lat and llm.config.spec is not None:
        print("warning: no propose ranges in the trace")
    return 0
