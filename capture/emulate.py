"""A CPU stand-in for ``torch.cuda.CUDAGraph``, so the whole pad -> replay -> slice path of
``GraphRunner`` (and the engine's use of it) is tested on machines without a GPU.

``EmulatedGraph`` honours the contract that matters for correctness: "capture" runs the captured
call (``fn`` on the static views) once and keeps its outputs; ``replay`` re-runs it on the same
static views (so with the captured host ints: max_query_len, the max_seq_len bucket) and writes
into those same output tensors. A live batch that is padded wrongly, sliced wrongly, or whose padding rows are not inert
gives different results here exactly as it would under a real graph. What it cannot show: stale
pointers and kernels that are not capturable (``python -m capture.selfcheck_cuda`` on a GPU).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from capture.cuda_graphs import GraphRunner


class EmulatedGraph:
    def __init__(self, run: Callable[[], Any]) -> None:
        self.run = run
        self.out = run()

    @torch.inference_mode()  # as captured: the outputs are inference tensors
    def replay(self) -> None:
        for dst, src in zip(tree_flatten(self.out)[0], tree_flatten(self.run())[0]):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


def emulate_graph(run: Callable[[], Any]) -> tuple[EmulatedGraph, Any]:
    """``capture_graph``'s stand-in: (graph, outputs)."""
    g = EmulatedGraph(run)
    return g, g.out


class EmulatedGraphRunner(GraphRunner):
    """``GraphRunner`` whose graphs are ``EmulatedGraph``s: enabled on any device."""

    enabled = property(lambda self: True)  # type: ignore[assignment]

    @torch.inference_mode()
    def _make_graph(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        return emulate_graph(run)
