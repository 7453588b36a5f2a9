"""Profiler ranges for the engine's phases, and their latencies read back from a trace.

The engine marks its phases with ``record_function`` ranges: ``prepare``, ``verify``,
``rejection_sample`` and ``propose`` (``phase``); ``phase_latencies`` reads them back from a
torch.profiler trace. The ``compiled-spec profile`` command that writes such a trace lives in
``profile_run.py``: this module stays below the engine that imports it.
"""
from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path

import torch
from torch.profiler import record_function

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
