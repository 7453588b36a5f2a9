"""Device time of a kernel call as our engine runs it: calls captured in one CUDA graph and
replayed, timed with CUDA events (the kernel benchmarks share it; launch cost off the clock)."""
from __future__ import annotations

from typing import Callable

import torch


def graph_us(call: Callable[[int], object], calls: int, iters: int = 10, warm: int = 3) -> float:
    """Mean microseconds per ``call(i)``, i = 0..calls-1, from ``iters`` replays of a graph that
    holds all ``calls`` calls (``warm`` eager calls first: Triton JIT, cuBLAS handles)."""
    for i in range(min(calls, warm)):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * iters)
