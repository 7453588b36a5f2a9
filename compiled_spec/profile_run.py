"""``compiled-spec profile``: a torch.profiler trace of generation, readable in TensorBoard
(torch-tb-profiler), with the propose / verify latencies read back from the trace itself
(``profile.phase_latencies``).
"""
from __future__ import annotations

import argparse
import glob
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from compiled_spec.profile import phase_latencies

if TYPE_CHECKING:
    from compiled_spec import LLM


def trace_calls(llm: "LLM", run: Callable[[], None], out_dir: Path, table_rows: int = 0
                ) -> str:
    """Run ``run`` under torch.profiler (CPU, and CUDA on a GPU) with a TensorBoard trace in
    ``out_dir``; with ``table_rows``, print the ops with the most device time (CPU time off a
    GPU). Returns the trace file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if llm.config.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, on_trace_ready=torch.profiler.
                                tensorboard_trace_handler(str(out_dir))) as prof:
        run()
    if table_rows:
        by = "self_cuda_time_total" if len(acts) > 1 else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=by, row_limit=table_rows,
                                        max_name_column_width=60))
    return max(glob.glob(str(out_dir / "*.pt.trace.json")), key=os.path.getmtime)


def print_phases(trace: str) -> dict[str, dict[str, float]]:
    """The engine phases' latencies read back from ``trace``, printed as a table."""
    lat = phase_latencies(trace)
    print(f"{'phase':18s} {'count':>6s} {'mean ms':>9s} {'p50 ms':>9s} {'p90 ms':>9s}  source")
    for phase, st in lat.items():
        print(f"{phase:18s} {st['count']:6d} {st['mean']:9.3f} {st['p50']:9.3f} {st['p90']:9.3f}  {st['source']}")
    return lat


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
        llm.generate(prompts[:batch], sp)
        secs, steps = time.perf_counter() - t0, llm.stats.num_steps - steps0
        print(f"untraced: batch {batch}, {steps} engine steps in {secs:.2f} s "
              f"({1e3 * secs / max(steps, 1):.2f} ms each)")
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
