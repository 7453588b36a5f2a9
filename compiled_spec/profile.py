"""Profiler ranges for the engine's phases, and their latencies read back from a trace.

The engine marks its phases with ``record_function`` ranges: ``prepare``, ``verify``,
``rejection_sample`` and ``propose`` (``phase``); ``phase_latencies`` reads them back from a
torch.profiler trace; ``trace_calls`` writes such a trace of any calls (``compiled-spec
profile`` in ``profile_run.py``, ``bench --trace-dir``). This module stays below the engine
that imports it.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch
from torch.profiler import record_function

if TYPE_CHECKING:
    from compiled_spec import LLM

PHASES = ("prepare", "verify", "rejection_sample", "propose")
_NO_RANGE = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager:
    """A ``record_function`` range while a profiler runs, else nothing: a range costs ~6 us of
    host time even unrecorded, four per engine step, on a host-bound path."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _NO_RANGE


def phase_latencies(trace_file: str) -> dict[str, dict[str, float]]:
    """Per phase: count, mean, p50, p90 in ms. GPU ranges (gpu_user_annotation) when present,
    since they include the kernels' run time; CPU ranges otherwise."""
    events = json.loads(Path(trace_file).read_text())["traceEvents"]
    out: dict[str, dict[str, float]] = {}
    for cat in ("gpu_user_annotation", "user_annotation"):
        for phase in PHASES:
            if phase in out:
                continue
            durs = sorted(e["dur"] / 1000 for e in events
                          if e.get("cat") == cat and e.get("name") == phase and "dur" in e)
            if durs:
                out[phase] = {"count": len(durs), "mean": statistics.fmean(durs),
                              "p50": durs[len(durs) // 2], "p90": durs[min(len(durs) - 1, int(0.9 * len(durs)))],
                              "source": cat}
    return out


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
