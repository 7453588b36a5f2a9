"""A CPU stand-in for ``torch.cuda.CUDAGraph``, so the whole pad -> replay -> slice path of
``GraphRunner`` (and the engine's use of it) is tested on machines without a GPU.

``EmulatedGraph`` honours the contract that matters for correctness: "capture" runs the captured
call (``fn`` on the static views) once and keeps its outputs; ``replay`` re-runs it on the same
static views (so with the captured host ints: max_query_len, the max_seq_len bucket) and writes
into those same output tensors. A live batch that is padded wrongly, sliced wrongly, or whose padding rows are not inert
gives different results here exactly as it would under a real graph. What it cannot show: stale
pointers and kernels that are not capturable (``python -m capture.selfcheck_cuda`` on a GPU).

It is strict about the outputs' lifetime: a real graph's outputs are valid only until the next
replay of any graph of the same memory pool (which may reuse their blocks). So a replay here
poisons the outputs of every other graph of its pool (NaN, or a large negative integer): code
that reads graph outputs after another replay, without copying them, fails the CPU tests
instead of reading stale memory on a GPU.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from capture.cuda_graphs import GraphRunner

_POOLS: dict[int, "weakref.WeakSet[EmulatedGraph]"] = {}  # id(pool) -> its graphs


def _poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype != torch.bool:
        t.fill_(-(1 << 30))


class EmulatedGraph:
    def __init__(self, run: Callable[[], Any], pool: Any = None) -> None:
        self.run = run
        self.out = run()
        self.pool = pool
        if pool is not None:
            _POOLS.setdefault(id(pool), weakref.WeakSet()).add(self)

    @torch.inference_mode()  # as captured: the outputs are inference tensors
    def replay(self) -> None:
        if self.pool is not None:  # the pool's other graphs' outputs are stale from here on
            for g in list(_POOLS.get(id(self.pool), ())):
                if g is not self:
                    for t in tree_flatten(g.out)[0]:
                        if isinstance(t, torch.Tensor):
                            _poison(t)
        for dst, src in zip(tree_flatten(self.out)[0], tree_flatten(self.run())[0]):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)


def emulate_graph(run: Callable[[], Any], pool: Any = None) -> tuple[EmulatedGraph, Any]:
    """``capture_graph``'s stand-in: (graph, outputs); graphs of one ``pool`` poison each
    other's outputs on replay (see the module docstring)."""
    g = EmulatedGraph(run, pool)
    return g, g.out


class EmulatedGraphRunner(GraphRunner):
    """``GraphRunner`` whose graphs are ``EmulatedGraph``s: enabled on any device."""

    enabled = property(lambda self: True)  # type: ignore[assignment]

    @torch.inference_mode()
    def _make_graph(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        return emulate_graph(run, self.pool)
