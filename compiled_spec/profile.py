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
                                tensorboard_trace_handler(str(out_dir))):
        run()
    trace = max(glob.glob(str(out_dir / "*.pt.trace.json")), key=os.path.getmtime)
    if table_rows:
        print(op_table(trace, table_rows, device=len(acts) > 1))
    return trace


def op_table(trace_file: str, rows: int, device: bool) -> str:
    """The ``rows`` ops with the most self time in a trace: kernels by device time when
    ``device``, CPU ops by self CPU time (their time less their child ops') otherwise. Read
    from the trace file: the profiler's own ``key_averages`` spent ~18 s of Python on a
    32-token CPU trace (forty-second session), longer than the traced run."""
    events = [e for e in json.loads(Path(trace_file).read_text())["traceEvents"]
              if e.get("ph") == "X" and "dur" in e]
    total: dict[str, float] = {}
    calls: dict[str, int] = {}
    if device:
        title = "Self device"
        for e in events:
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
                total[e["name"]] = total.get(e["name"], 0.0) + e["dur"]
                calls[e["name"]] = calls.get(e["name"], 0) + 1
    else:
        title = "Self CPU"
        by_thread: dict[tuple, list[dict]] = {}
        for e in events:
            if e.get("cat") == "cpu_op":
                by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
        for evs in by_thread.values():
            evs.sort(key=lambda e: (e["ts"], -e["dur"]))
            stack: list[list] = []  # [end, name, self us] of the enclosing ops
            for e in evs + [None]:
                while stack and (e is None or e["ts"] >= stack[-1][0]):
                    _, name, own = stack.pop()
                    total[name] = total.get(name, 0.0) + own
                if e is None:
                    break
                if stack:
                    stack[-1][2] -= e["dur"]
                calls[e["name"]] = calls.get(e["name"], 0) + 1
                stack.append([e["ts"] + e["dur"], e["name"], float(e["dur"])])
    grand = sum(total.values()) or 1.0
    lines = [f"{'name':60s} {'calls':>7s} {title + ' ms':>15s} {'%':>6s} {'us/call':>9s}"]
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:rows]:
        lines.append(f"{name[:60]:60s} {calls[name]:7d} {us / 1e3:15.3f} "
                     f"{100 * us / grand:6.1f} {us / calls[name]:9.1f}")
    return "\n".join(lines)


def print_phases(trace: str) -> dict[str, dict[str, float]]:
    """The engine phases' latencies read back from ``trace``, printed as a table."""
    lat = phase_latencies(trace)
    print(f"{'phase':18s} {'count':>6s} {'mean ms':>9s} {'p50 ms':>9s} {'p90 ms':>9s}  source")
    for phase, st in lat.items():
        print(f"{phase:18s} {st['count']:6d} {st['mean']:9.3f} {st['p50']:9.3f} {st['p90']:9.3f}  {st['source']}")
    return lat
