"""How capture failures are reported and handled: ``CaptureError`` (a component is missing
graphs it was expected to have, or strict capture failed), ``describe_error`` (the text each
failure record and warning carries) and ``capture_retrying`` (a capture that failed to compile
tried once more, its failed shapes then eager)."""
from __future__ import annotations

import traceback
import warnings
from typing import Any, Callable

from torch._dynamo.exc import BackendCompilerFailed


class CaptureError(RuntimeError):
    """A component is missing graphs it was expected to have (or strict capture failed)."""


def _message(e: BaseException) -> str:
    """The exception's text without torch's advice lines (``Set TORCHDYNAMO_VERBOSE=1 ...``)."""
    lines = [ln for ln in str(e).strip().splitlines() if not ln.startswith("Set TORCHDYNAMO_")]
    return "\n".join(lines).strip()


def describe_error(e: BaseException) -> str:
    """``Type: message`` plus where the innermost cause was raised (file:line and its source
    line). A compiler's ``AssertionError`` has an empty message, and Inductor wraps it in an
    ``InductorError`` whose text is only advice: without the place, a failed capture recorded
    on a remote GPU cannot be told apart from any other."""
    inner = e
    seen: set[int] = set()
    while id(inner) not in seen:
        seen.add(id(inner))
        nxt = inner.__cause__ or getattr(inner, "inner_exception", None) or inner.__context__
        if not isinstance(nxt, BaseException):
            break
        inner = nxt
    text = f"{type(e).__name__}: {_message(e)}"
    if inner is not e:
        text += f" <- {type(inner).__name__}: {_message(inner)}"
    frames = traceback.extract_tb(inner.__traceback__)
    if frames:
        f = frames[-1]
        text += f" (at {f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()})"
    return text


def capture_retrying(capture_once: Callable[[], None], strict: bool, name: str,
                     where: dict[str, Any], failures: list[dict[str, Any]]) -> None:
    """``capture_once()``; after a compile failure (the backend raised; not when ``strict``)
    once more: the shapes that failed to compile now run their eager callables
    (``compiled_spec.compile_guard``), so the graph holds those ops instead of none at all.
    A retry that captured is recorded in ``failures`` (``where`` plus the error) and warned;
    any other failure, or the retry's, raises (the caller records it)."""
    try:
        capture_once()
        return
    except BackendCompilerFailed as e:
        if strict:
            raise
        why = describe_error(e)
    capture_once()
    failures.append({**where, "error": why,
                     "captured": "with the eager callables of what failed to compile"})
    warnings.warn(f"{name}: compiling failed for {where} ({why}); captured with the eager "
                  "callables instead", RuntimeWarning, stacklevel=3)
