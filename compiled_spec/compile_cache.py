"""The persistent compile cache: where Inductor (and the Triton kernels it builds) keep compiled
artifacts between processes, and how many of this start-up's graphs came from it.

Inductor already caches compiled FX graphs and AOTAutograd graphs on disk, keyed by the graph,
its inputs' metadata, the configuration and custom passes (ours fold their uuid into the key,
see ``passes/post_grad.py``). By default that cache lives under the system temp directory, which
machines clear; like vLLM we point it at a directory of our own that survives reboots. A second
start-up of the same configuration then skips Inductor's code generation and C++/Triton builds;
Dynamo's tracing and our passes still run.

Inductor's key does not cover everything our code decides at run time: an artifact compiled
when the KV caches were views of one tensor (aliased inputs) was served to caches that were
separate tensors, and the process crashed (2026-12-01). So our directory holds one subdirectory
per version of the code that is traced (``code_hash``): new code never meets old artifacts.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ENV = "TORCHINDUCTOR_CACHE_DIR"  # read by Inductor whenever it resolves its cache directory
# The code that shapes compiled graphs: the package and the passes, kernels and capture code.
_ROOT = Path(__file__).resolve().parents[1]
_TRACED = ("compiled_spec", "passes", "kernels", "capture")


@lru_cache(maxsize=None)
def code_hash(root: Path = _ROOT) -> str:
    """16 hex digits over the Python sources under ``root``'s traced packages (names and
    contents), and torch's version."""
    import torch

    h = hashlib.sha256(torch.__version__.encode())
    for pkg in _TRACED:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    """``$COMPILED_SPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/compiled_spec/inductor``, else
    ``~/.cache/compiled_spec/inductor``."""
    if os.environ.get("COMPILED_SPEC_CACHE_DIR"):
        return Path(os.environ["COMPILED_SPEC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "compiled_spec" / "inductor"


def activate(cache_dir: str | None) -> str | None:
    """Point Inductor at ``cache_dir`` (``""``: leave Inductor's own default) for the rest of the
    process and return the directory in use: ``cache_dir`` (default ``default_cache_dir()``)
    / ``code-<code_hash()>``. A ``TORCHINDUCTOR_CACHE_DIR`` the user exported wins over our
    default, never over an explicit ``cache_dir``. Process-wide on purpose: graphs compiled
    later (a new shape mid-serving) must land in the same cache. Triton's binaries are pinned
    beside it (``pin_triton``)."""
    if cache_dir == "":
        return os.environ.get(ENV)
    if cache_dir is None and _user_exported():
        pin_triton(Path(os.environ[ENV]) / "triton")
        return os.environ[ENV]
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = base / f"code-{code_hash()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"compile cache directory {str(path)!r} cannot be created: {e}") from None
    global _our_inductor_dir
    os.environ[ENV] = _our_inductor_dir = str(path)
    pin_triton(base / "triton")
    return str(path)


_pinned_triton: str | None = None  # the TRITON_CACHE_DIR this process set (not a user's)
_our_inductor_dir: str | None = None  # the TORCHINDUCTOR_CACHE_DIR this process set


def pin_triton(path: Path) -> None:
    """Set ``TRITON_CACHE_DIR`` to ``path`` now, unless a user exported it. Left unset, Inductor
    sets it to ``<its cache>/triton/<device>`` only when it first builds a kernel tuner in this
    process: kernels built before that (by its compile workers on a cold start) landed in
    Triton's ``~/.triton/cache``, the same kernels loaded from a precompiled artifact next time
    were looked up in Inductor's folder and built again (the thirty-sixth session's H100: 20
    kernels; start-ups of 37.1 s cold, 16.5 s, then 7.2 s once the third found them). One folder,
    chosen before anything compiles, makes the second start-up the warm one. Outside the
    ``code-*`` folders: Triton keys its binaries by their source, so new code of ours reuses
    the kernels it did not change."""
    global _pinned_triton
    current = os.environ.get("TRITON_CACHE_DIR")
    if current and current != _pinned_triton:
        return  # the user's
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:  # e.g. a read-only user cache: Triton's own choice stands
        return
    os.environ["TRITON_CACHE_DIR"] = _pinned_triton = str(path)


def _user_exported() -> bool:
    """Whether ``TORCHINDUCTOR_CACHE_DIR`` holds a directory a user chose. Importing
    torch._dynamo writes Inductor's own default there (torch 2.11-2.13: its package cache and the
    compiler bisector resolve the cache directory at import), so a value equal to that default
    is torch's, not the user's: taking it for a user's export left every artifact in the temp
    directory instead of ours (found 2026-12-01, eighth session)."""
    value = os.environ.get(ENV)
    if not value or value == _our_inductor_dir:
        # Ours from an earlier activate (a compile=True engine activates twice): taken for a
        # user's, it re-pinned Triton into <code-*>/triton mid-process, so kernels built before
        # and after landed in two folders, and the thirty-seventh session's second warm start
        # built 15 of Inductor's kernels again.
        return False
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir as torch_default
    except ImportError:  # another torch layout: trust the variable
        return True
    return os.path.abspath(value) != os.path.abspath(torch_default())


_KEYS = {"fxgraph_hit": ("inductor", "fxgraph_cache_hit"),
         "fxgraph_miss": ("inductor", "fxgraph_cache_miss"),
         "aot_hit": ("aot_autograd", "autograd_cache_hit"),
         "aot_miss": ("aot_autograd", "autograd_cache_miss"),
         "aot_bypass": ("aot_autograd", "autograd_cache_bypass")}

# torch's own compile timers (``dynamo_timed``; seconds summed over every compilation) that split
# a start-up once the FX cache hits: a warm start on the H200 still spent 43 s outside Inductor
# (ninth session), and these say whether Dynamo's tracing, AOTAutograd or guards hold it. A name
# a torch version lacks reads 0.
_TIMERS = {"dynamo": "_compile.compile_inner",  # all of Dynamo's compiles, backends included
           "trace": "bytecode_tracing",  # Dynamo's symbolic run of the Python code
           "backend": "OutputGraph.call_user_compiler",  # our backend: passes, AOT, Inductor
           "aot": "create_aot_dispatcher_function",  # AOTAutograd (traced again on a miss)
           "inductor": "compile_fx_inner",  # Inductor (a cache hit loads the artifact)
           "guards": "build_guards"}


def _read() -> dict[str, float]:
    from torch._dynamo.utils import compilation_time_metrics, counters

    out: dict[str, float] = {k: int(counters[group][name]) for k, (group, name) in _KEYS.items()}
    out.update({f"{k}_s": float(sum(compilation_time_metrics.get(name, ())))
                for k, name in _TIMERS.items()})
    return out


@dataclass
class CacheStats:
    """Cache hits and misses of one LLM's compilation, and torch's compile timers ("seconds").
    torch counts per process, so these are deltas from when this LLM started compiling (another
    LLM compiling in the same process in the meantime would be counted too)."""

    dir: str | None
    _start: dict[str, float]

    @classmethod
    def begin(cls, cache_dir: str | None) -> "CacheStats":
        return cls(cache_dir, _read())

    def as_dict(self) -> dict[str, object]:
        now = _read()
        seconds = {k: round(now[k] - self._start[k], 2) for k in now if k.endswith("_s")}
        return {"dir": self.dir, **{k: int(now[k] - self._start[k]) for k in _KEYS},
                "seconds": seconds}
