"""Attention warm-up left running at start-up (``kernels.warmup``, cold Triton cache): worker
processes compile the attention binaries while the engine goes on to trace and compile the
model, which launches no kernel. The first attention-family launch (``kernels.ops``) or the end
of start-up, whichever comes first, joins them: it waits for the workers, then loads every
binary with one launch each. On the H200 a cold start spent 11-16 s in that warm-up before
compiling anything (twenty-sixth session); the model's compile takes longer than the workers.

Kept apart from ``kernels.warmup`` so ``kernels.dispatch`` checks the list without importing it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

PENDING: list[Callable[[], None]] = []  # each joins one engine's workers and loads the binaries


def finish() -> None:
    """Run every pending join (no-op when none). Refuses inside a CUDA-graph capture: the
    loading launches would be captured into the graph."""
    if not PENDING:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("attention warm-up still pending inside a CUDA-graph capture: "
                           "capture must run its dummy runs first (warmup_iters >= 1)")
    while PENDING:
        PENDING.pop(0)()
