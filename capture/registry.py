"""The engine's graph components in one place: ``GraphRegistry`` builds every ``GraphRunner``
on one shared memory pool, captures them all at start-up, and ``assert_captured`` refuses to
start when any named component (the draft included) has no graph: the check that catches a
draft that is never captured (seeds/003).
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from capture.cuda_graphs import GraphFn, GraphRunner
from capture.errors import CaptureError
from capture.pad import StaticBuffers


def assert_captured(runners: Mapping[str, GraphRunner], *names: str) -> None:
    """Raise CaptureError unless every named component (all registered ones when no names are
    given) was registered and has at least one captured graph. Call it at start-up when CUDA
    graphs are on; on the CPU nothing is captured, so it always raises there."""
    for name in names or tuple(runners):
        if name not in runners:
            raise CaptureError(f"{name!r} was never registered for CUDA-graph capture: it would "
                               f"run without graphs (registered: {sorted(runners)})")
        r = runners[name]
        if not r.captured_sizes:
            why = "device is not CUDA" if not r.enabled else (
                f"all {len(r.capture_failures)} captures failed: {r.capture_failures[:1]}"
                if r.capture_failures else "capture() was never called (no dummy runs)")
            raise CaptureError(f"{name!r} has zero captured CUDA graphs ({why})")


class GraphRegistry:
    """The engine's components and the one graph memory pool they share."""

    def __init__(self, device: torch.device, strict: bool = False,
                 runner_cls: type[GraphRunner] | None = None) -> None:
        """``runner_cls``: the GraphRunner class to build (tests: ``EmulatedGraphRunner``)."""
        self.device = torch.device(device)
        self.strict = strict  # engine option: a failed capture raises instead of warning
        # Off CUDA a token stands for the pool: emulated graphs of one registry share it.
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else object()
        self.runner_cls = runner_cls or GraphRunner
        self.runners: dict[str, GraphRunner] = {}
        # Wall seconds of each component's capture (its dummy runs, compiles met on the way and
        # the captures): where a start-up's "capture" phase goes.
        self.capture_s: dict[str, float] = {}

    def register(self, name: str, fn: GraphFn, sizes: list[int], buffers: StaticBuffers,
                 **kwargs: Any) -> GraphRunner:
        if name in self.runners:
            raise ValueError(f"component {name!r} registered twice")
        kwargs.setdefault("strict", self.strict)
        runner = self.runner_cls(name, fn, sizes, buffers, pool=self.pool, **kwargs)
        self.runners[name] = runner
        return runner

    def capture_all(self) -> None:
        for name, runner in self.runners.items():
            t0 = time.perf_counter()
            runner.capture()
            self.capture_s[name] = time.perf_counter() - t0

    def assert_captured(self, *names: str) -> None:
        assert_captured(self.runners, *names)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {name: {**r.stats(), "capture_s": round(self.capture_s.get(name, 0.0), 3)}
                for name, r in self.runners.items()}
