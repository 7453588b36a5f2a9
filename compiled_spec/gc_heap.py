"""Python's cyclic garbage collector against the serving loop.

A compiled engine's process holds hundreds of thousands of long-lived objects (Dynamo's and
Inductor's state, FX graphs, guards, the captured graphs' bookkeeping): a full (generation 2)
collection walks all of them. On this project's CI machine one took ~200 ms after a tree
engine had run (CPU, 676k tracked objects; 0.0015 ms after ``gc.freeze``). Python starts such a
collection by itself whenever enough objects have outlived the younger generations, i.e. at
some step in the middle of serving. (It was the first suspect for the H200's one 126-230 ms
tree step at batch 4 / 16, eighteenth session; that step turned out to be first kernel launches,
see ``engine.tree_verify.warm_mixed_verify``, and no full collection landed in a timed step.)

So, as vLLM does after start-up, an engine collects once when it is ready and moves what is
left into the permanent generation (``gc.freeze``), which no collection walks: later full
collections see only what serving allocated. A new engine thaws the heap first, so what an
earlier, dropped engine left (its KV pool in reference cycles) is collected, not kept.

``CLOCK`` times every full collection in the process; the engine counts those that ran inside
its steps (``EngineStats.gc_full_collections``), so a pause is never silent.
"""
from __future__ import annotations

import gc
import os
import time

import torch


class FullCollectionClock:
    """A ``gc.callbacks`` hook: how many generation-2 collections ran, and their seconds."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.count += 1


CLOCK = FullCollectionClock()
if not any(isinstance(cb, FullCollectionClock) for cb in gc.callbacks):
    gc.callbacks.append(CLOCK)


def freeze_default(device: torch.device) -> bool:
    """Whether an engine freezes the start-up heap when not told: COMPILED_SPEC_GC_FREEZE (0 or
    1) if set, else on for CUDA devices, where a 100 ms pause is ~50-100 decode steps. (On the
    CPU a step is slow anyway, and each engine's start-up collection would cost the test suite
    its hundreds of engines times a full collection.)"""
    env = os.environ.get("COMPILED_SPEC_GC_FREEZE")
    if env is not None:
        return env != "0"
    return device.type == "cuda"


def thaw() -> None:
    """Give frozen objects back to the collector (a new engine starts, or one shuts down)."""
    gc.unfreeze()


def freeze_startup_heap() -> float:
    """Collect once, then freeze every surviving object; returns the collection's seconds."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t0
