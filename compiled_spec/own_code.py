"""A bound method re-bound to a function with its own copy of the code object, so that each
engine's torch.compile of a method every instance shares keeps its own Dynamo cache.

Dynamo keys its cache entries on the code object. Two engines in one process that compile the
same method (the chain picker's ``pick_and_plan``, the tree's glue) put their entries on one
code object, and a recompile for the second engine has Dynamo explain why the first one's
entries failed: it evaluates their guard sources against the new frame. With an EAGLE-3
engine first and an EAGLE-1 engine next, a source such as
``L['self']._modules['draft']._buffers['d2t']`` (EAGLE-3 only) raised KeyError inside torch
(2.13, ``recompilation_reason_for_no_tensor_aliasing_guard``): the second engine's early
propose graphs failed to capture (thirty-third session, ``tests/test_own_code.py``). With a
code object per engine there is nothing of another engine's to explain, and no engine counts
toward another's recompile limit. nn.Modules (compiled through ``forward``) are left as they
are: their Dynamo entries are keyed on the module's ``forward`` code as torch.compile does.
"""
from __future__ import annotations

import inspect
import types
from typing import Any


def own_code(fn: Any) -> Any:
    """``fn`` itself unless it is a bound method; then the same method over a copy of its
    function whose code object is new (equal, not identical)."""
    if not inspect.ismethod(fn):
        return fn
    f = fn.__func__
    g = types.FunctionType(f.__code__.replace(), f.__globals__, f.__name__, f.__defaults__,
                           f.__closure__)
    g.__kwdefaults__ = f.__kwdefaults__
    g.__qualname__, g.__module__, g.__doc__ = f.__qualname__, f.__module__, f.__doc__
    g.__dict__.update(f.__dict__)
    g.__annotations__ = dict(getattr(f, "__annotations__", {}))
    return types.MethodType(g, fn.__self__)
