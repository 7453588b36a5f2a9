"""Input shapes a compiled callable failed to compile for, run eagerly from then on (counted).

A backend failure (``BackendCompilerFailed``, Inductor's errors included) raises where it
happens, as before: at start-up a capture records it (``capture.errors``), in a step the engine's
fault path recovers the step's requests. Without this, every later call of that shape would
compile again, seconds each, and fail again: the sixteenth session's H200 run had the draft
tree's graphs fail to compile at batch 4 and 16, so every step of more than one request would
have paid a failing compile and a retry of each request alone. Here the shape is remembered: the
next calls of it run the eager callable, counted (``stats``) and warned once per shape, never
silently, and graph replays of the sizes that did capture are untouched.

A shape is the tensors' sizes (and the names of other leaves) of the call's arguments, looking
one level into dataclasses (``AttentionMetadata``): with ``dynamic=True`` one failed compile
usually stands for several shapes, and each of those fails once before it is remembered.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch._dynamo.exc import BackendCompilerFailed

from capture.errors import describe_error

log = logging.getLogger(__name__)

ShapeKey = tuple[Any, ...]


def _leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    if isinstance(x, (int, float, bool, str)) or x is None:
        return x
    return type(x).__name__


def shape_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> ShapeKey:
    """What decides whether a compile of this call fails: tensor sizes, scalars, and the
    fields of dataclass arguments (their tensors' sizes), in argument order."""
    out: list[Any] = []
    for x in (*args, *(kwargs[k] for k in sorted(kwargs))):
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            out.append(tuple(_leaf(getattr(x, f.name)) for f in dataclasses.fields(x)))
        elif isinstance(x, (list, tuple)):
            out.append(tuple(_leaf(v) for v in x))
        elif isinstance(x, dict):
            out.append(tuple((k, _leaf(x[k])) for k in sorted(x)))
        else:
            out.append(_leaf(x))
    return tuple(out)


class CompileGuard:
    """Wraps one compiled callable: calls of a shape whose compile failed run ``eager``."""

    def __init__(self, name: str, eager: Callable[..., Any]) -> None:
        self.name = name
        self.eager = eager
        self.failures: dict[ShapeKey, str] = {}  # shape -> the compile error
        self.eager_calls = 0

    def __call__(self, compiled: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        # No key is built until a compile has failed: nothing added to the calls' host time.
        if self.failures and shape_key(args, kwargs) in self.failures:
            self.eager_calls += 1
            return self.eager(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except BackendCompilerFailed as e:
            key = shape_key(args, kwargs)
            why = self.failures[key] = describe_error(e)
            log.warning("%s: compiling failed for shape %s; calls of that shape run eagerly "
                        "from now on (counted in compile stats): %s", self.name, key, why)
            raise

    def stats(self) -> dict[str, Any]:
        return {"failed_shapes": len(self.failures), "eager_calls": self.eager_calls,
                "errors": sorted(set(self.failures.values()))}
