"""Capturing one call as a sequence of CUDA graphs, cut where the call reaches a split point.

Why: in the sixth session's profiler traces the GPU started a kernels-only graph only after the
host's whole ``cudaGraphLaunch`` (~1.25 us per kernel node) had returned. Cut into pieces
launched back to back, the GPU would start on piece 1 while the host launches piece 2.

The forward marks split points with ``compiled_spec::graph_split`` (``kernels/ops.py``; the
target places one after every N layers, ``CompileConfig.graph_split_every``). The op calls
``split_point()``: inside ``capture_split`` that ends the graph being captured and begins the
next on the same stream and memory pool; anywhere else it does nothing. Pieces share one pool
and are always replayed in capture order, the condition under which graphs may share memory.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

_local = threading.local()  # the cut callback of the split capture running on this thread


@contextmanager
def cutting(on_cut: Callable[[], None]) -> Iterator[None]:
    """Within the block, every split point the running code reaches calls ``on_cut``."""
    prev = getattr(_local, "on_cut", None)
    _local.on_cut = on_cut
    try:
        yield
    finally:
        _local.on_cut = prev


def split_point() -> None:
    """Called by ``compiled_spec::graph_split`` (capture time only; free otherwise)."""
    on_cut = getattr(_local, "on_cut", None)
    if on_cut is not None:
        on_cut()


class GraphSequence:
    """The pieces of one captured call, replayed in order."""

    def __init__(self, graphs: list[Any]) -> None:
        self.graphs = graphs

    def replay(self) -> None:
        for g in self.graphs:
            g.replay()

    def __len__(self) -> int:
        return len(self.graphs)


def capture_split(run: Callable[[], Any], pool: Any, stream: torch.cuda.Stream
                  ) -> tuple[GraphSequence, Any]:
    """Capture one call of ``run`` on ``stream`` into ``pool``, one graph per piece between
    split points. Returns (the pieces, the call's outputs)."""
    graphs: list[torch.cuda.CUDAGraph] = []

    def begin() -> None:
        g = torch.cuda.CUDAGraph()
        g.capture_begin(pool=pool if pool is not None or not graphs else graphs[0].pool())
        graphs.append(g)

    def cut() -> None:
        graphs[-1].capture_end()
        begin()

    with torch.cuda.stream(stream):
        begin()
        try:
            with cutting(cut):
                out = run()
        finally:
            graphs[-1].capture_end()
    return GraphSequence(graphs), out
