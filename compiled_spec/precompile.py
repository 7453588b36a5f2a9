"""Issue 16: skip Dynamo on a warm start by loading torch's ahead-of-time precompiled functions
(``torch.compile(...).aot_compile`` / ``AOTCompiledFunction``) instead of tracing again.

A warm start with every Inductor / AOTAutograd cache hit still pays Dynamo's symbolic run of the
Python code (H200: 13 s of a 30.6 s start-up, ninth session). An ``AOTCompiledFunction`` holds
Dynamo's guards, the bytecode it generated and the backend's compiled graph (AOTAutograd's
bundled cache entry, Inductor code included); loading one costs no trace.

What it needs from our backend: the callable the backend returns must be serializable. The
target's is AOTAutograd's bundled entry (``compile_fx``'s result) as is. A draft's backend wraps
its compiled graph in ``passes.pipeline.PlanRunner`` (the hoisted EAGLE-3 fc, the call plan,
per-layer metadata): saved as the bundled entry, the plan and the hoisted GraphModule, and
rebuilt at load bound to the loading engine's backend (``_SerializableRunner``). What torch
compiles must be a module's method (``type(module).<method>`` with the module an argument,
guarded like a module call), never a method of an object whose state Dynamo's guard pickler
cannot pickle: the chain's step + pick (``spec/draft_pick.py``) and the draft tree's glue
(``spec/tree_glue.py``) are modules for this.

One file per callable and configuration holds every specialisation compiled so far (a guard
miss, e.g. batch 1's 0/1 specialisation, compiles and appends one more); a call tries each
entry's guards in order. Any failure to load or compile is counted with its reason and the
callable falls back to ``torch.compile``'s traced path: never silently.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from passes.pipeline import CompiledSpecBackend, GraphStats, PlanRunner


def available() -> str | None:
    """None when this torch can precompile, else why not (every piece is looked up, no
    version test: torch 2.11 and 2.13 differ, see ``_Serializable``)."""
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction  # noqa: F401
        from torch._dynamo.aot_compile_types import SerializableCallable  # noqa: F401
    except ImportError as e:
        return f"torch {torch.__version__} has no torch._dynamo.aot_compile ({e})"
    if not hasattr(torch._dynamo.config, "enable_aot_compile"):
        return f"torch {torch.__version__} has no torch._dynamo.config.enable_aot_compile"
    with torch._dynamo.config.patch(enable_aot_compile=True):
        if not hasattr(torch.compile(_probe, fullgraph=True), "aot_compile"):
            return f"torch {torch.__version__}: torch.compile(...) has no aot_compile"
    return None


def _probe(x: torch.Tensor) -> torch.Tensor:
    return x


try:  # torch versions without aot_compile: available() says why, nothing here is used
    from torch._dynamo.aot_compile_types import (
        BundledAOTAutogradSerializableCallable as _Bundled, SerializableCallable as _SerializableBase)
except ImportError:  # pragma: no cover - torch without precompile
    _Bundled, _SerializableBase = None, object


class _Serializable(_SerializableBase):  # type: ignore[misc, valid-type]
    """Our backend's compiled graph (``compile_fx``'s AOTAutograd entry) marked serializable.
    torch 2.11's aot_compile accepts only its own backends' results (2.13 also any result with
    ``serialize``). torch's wrapper cannot be returned itself: it forwards ``serialize``, and
    2.13 would wrap it again. So no ``serialize`` here. Saved entries refer to this class by
    name (module level, importable in a fresh process)."""

    def __init__(self, inner: Any) -> None:
        self._bundled = _Bundled(inner)

    @classmethod
    def serialize_compile_artifacts(cls, fn: Any) -> bytes:
        return _Bundled.serialize_compile_artifacts(fn._bundled)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Any:
        return _Bundled.deserialize_compile_artifacts(data)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._bundled(*args, **kwargs)


# The backend a draft's PlanRunner is rebuilt for while ``PrecompiledModule`` loads its file:
# deserialize_compile_artifacts is a classmethod torch calls with the bytes alone.
_LOADING: ContextVar[CompiledSpecBackend | None] = ContextVar("compiled_spec_precompile_backend",
                                                              default=None)


@contextmanager
def _loading_for(backend: Any) -> Iterator[None]:
    token = _LOADING.set(backend if isinstance(backend, CompiledSpecBackend) else None)
    try:
        yield
    finally:
        _LOADING.reset(token)


class _SerializableRunner(_SerializableBase):  # type: ignore[misc, valid-type]
    """A draft's ``PlanRunner`` marked serializable: its compiled graph as AOTAutograd's bundled
    entry, its call plan and its hoisted GraphModule (the EAGLE-3 fc, run eagerly) pickled.
    The backend it reads per-layer metadata from is the loading engine's, not saved."""

    def __init__(self, runner: PlanRunner) -> None:
        self.runner = runner

    @classmethod
    def serialize_compile_artifacts(cls, fn: Any) -> bytes:
        r = fn.runner
        return pickle.dumps({"compiled": _Bundled.serialize_compile_artifacts(_Bundled(r.compiled)),
                             "plan": r.plan, "hoisted": r.hoisted,
                             "hoisted_args": r.hoisted_args})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> Any:
        backend = _LOADING.get()
        if backend is None:  # its per-layer metadata would never be bound: refuse, not guess
            raise RuntimeError("a draft's saved graph runner loads only through "
                               "PrecompiledModule with the engine's backend")
        state = pickle.loads(data)
        compiled = _Bundled.deserialize_compile_artifacts(state["compiled"])
        return PlanRunner(compiled, state["plan"], state["hoisted"], state["hoisted_args"],
                          backend)

    def __call__(self, *args: Any) -> Any:
        return self.runner(*args)


def serializable_backend(backend: Any) -> Callable[..., Any]:
    """``backend`` whose results aot_compile can save on torch 2.11 and 2.13: AOTAutograd's
    entries, and the drafts' plan runners around one. Others (an eager backend's graph) pass
    through, and aot_compile refuses them."""
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        out = backend(gm, example_inputs)
        if isinstance(out, PlanRunner) and getattr(out.compiled, "serialize", None) is not None:
            return _SerializableRunner(out)
        return _Serializable(out) if getattr(out, "serialize", None) is not None else out

    return compile_graph


@dataclass
class PrecompileStats:
    """What the precompiled callables of one LLM did; reported in ``LLM.compile_cache``."""

    loaded: int = 0  # entries read from disk
    hits: int = 0  # loaded entries that served a call (no Dynamo trace)
    compiled: int = 0  # entries traced by aot_compile in this process and saved
    fallbacks: list[str] = field(default_factory=list)  # why a callable traced instead
    traced: dict[str, str] = field(default_factory=dict)  # callables never precompiled: why
    load_s: float = 0.0  # reading and deserializing entries (guards rebuilt, Inductor loaded)
    compile_s: float = 0.0  # aot_compile + serialize + write of new entries

    def as_dict(self) -> dict[str, Any]:
        return {"loaded": self.loaded, "hits": self.hits, "compiled": self.compiled,
                "fallbacks": list(self.fallbacks), "traced": dict(self.traced),
                "load_s": round(self.load_s, 2), "compile_s": round(self.compile_s, 2)}


def cache_key(name: str, module: torch.nn.Module, backend_uuid: str, parts: dict[str, Any]) -> str:
    """Everything that changes the traced graph: the callable, the module's class, config and
    parameter dtypes / devices, the backend's passes (uuid), the compile options and engine
    settings in ``parts`` (k, ...), torch's version and our code (``code_hash``: the
    cache directory holds it too, unless a user exported TORCHINDUCTOR_CACHE_DIR)."""
    from compiled_spec.compile_cache import code_hash

    params = sorted({(str(p.dtype), str(p.device)) for p in module.parameters()})
    text = repr((code_hash(), name, type(module).__qualname__, repr(getattr(module, "config", None)), params,
                 backend_uuid, sorted(parts.items()), torch.__version__))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class PrecompiledModule:
    """``module(*args)`` through precompiled entries; misses aot-compile (and save) a new one,
    failures go to ``traced`` (the ordinary ``torch.compile`` callable)."""

    def __init__(self, name: str, module: torch.nn.Module, backend: Any, dynamic: bool,
                 traced: Callable[..., Any], path: Path, stats: PrecompileStats,
                 method: str = "forward") -> None:
        self.name, self.module, self.backend, self.dynamic = name, module, backend, dynamic
        self.method = method  # which of the module's methods this serves
        self.traced = traced
        self.path = path
        self.stats = stats
        self.entries: list[Any] = []  # AOTCompiledFunction, in the order they were compiled
        # Their serialized form with the backend's stats of the graphs each compiled (our
        # passes' matches), rewritten on each new entry; loading hands the stats back to the
        # backend (marked precompiled), so ``compile_stats`` reads as on a traced start.
        self._blobs: list[tuple[bytes, list[dict[str, Any]]]] = []
        self._unused: set[int] = set()  # loaded entries not yet counted as a hit
        self.off: str | None = available()  # set: every miss traces
        if self.off is not None:
            stats.fallbacks.append(f"{name}: {self.off}")
        else:
            self._load()

    def _load(self) -> None:
        if not self.path.exists():
            return
        from torch._dynamo.aot_compile import AOTCompiledFunction

        t0 = time.perf_counter()
        try:
            blobs = pickle.loads(self.path.read_bytes())
            # Tensor guards compare dispatch keys including the thread's local ones, taken when
            # the guards are rebuilt here: the engine calls under inference mode (no
            # ADInplaceOrView), so rebuild them under it too, else every guard fails.
            with torch.inference_mode(), _loading_for(self.backend):
                entries = [AOTCompiledFunction.deserialize(b) for b, _ in blobs]
        except Exception as e:  # a torch upgrade, a truncated file: trace, say so, rewrite
            self.stats.fallbacks.append(f"{self.name}: load failed: {type(e).__name__}: "
                                        f"{str(e)[:200]}")
            return
        finally:
            self.stats.load_s += time.perf_counter() - t0
        self.entries, self._blobs = entries, list(blobs)
        for _, graph_stats in blobs:
            self._restore_stats(graph_stats)
        self._unused = set(range(len(entries)))
        self.stats.loaded += len(entries)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for i, entry in enumerate(self.entries):
            # The guards Dynamo would check before reusing a graph (shapes, dtypes, 0/1
            # specialisations), restored from the file; global guards were dropped at save
            # (torch's aot_compile does), which the cache key stands in for.
            if entry.guard_check(self.module, *args, **kwargs):
                if i in self._unused:
                    self._unused.discard(i)
                    self.stats.hits += 1
                return entry.fn(self.module, *args, **kwargs)
        if self.off is None:
            entry = self._compile(args, kwargs)
            if entry is not None:
                return entry.fn(self.module, *args, **kwargs)
        return self.traced(*args, **kwargs)

    def _restore_stats(self, graph_stats: list[dict[str, Any]]) -> None:
        graphs = getattr(self.backend, "graphs", None)
        if graphs is None:
            return
        for g in graph_stats:
            graphs.append(GraphStats(**{**g, "index": len(graphs), "precompiled": True}))

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from torch._dynamo.aot_compile import AOTCompiledFunction

        t0 = time.perf_counter()
        try:
            # The unbound forward, so the module is an argument (guarded like Dynamo guards a
            # module call) rather than state the serializer would have to pickle.
            # torch.compile reads enable_aot_compile when it builds its wrapper (torch 2.11
            # defaults it off), so the patch covers both calls.
            graphs_before = len(getattr(self.backend, "graphs", ()))
            with torch._dynamo.config.patch(enable_aot_compile=True):
                fn = torch.compile(getattr(type(self.module), self.method),
                                   backend=serializable_backend(self.backend),
                                   dynamic=self.dynamic, fullgraph=True)
                entry = fn.aot_compile(((self.module, *args), kwargs))
            graph_stats = [asdict(g) for g in getattr(self.backend, "graphs", [])[graphs_before:]]
            blob = AOTCompiledFunction.serialize(entry)
            # torch 2.13 returns an AOTCompileSaveResult, older versions the bytes themselves
            blob = getattr(blob, "serialized_data", blob)
        except Exception as e:
            self.stats.compile_s += time.perf_counter() - t0
            self.off = f"{self.name}: aot_compile failed: {type(e).__name__}: {str(e)[:200]}"
            self.stats.fallbacks.append(self.off)
            return None
        self.entries.append(entry)
        self._blobs.append((blob, graph_stats))
        self.stats.compiled += 1
        try:
            _atomic_write(self.path, pickle.dumps(self._blobs))
        except OSError as e:
            self.stats.fallbacks.append(f"{self.name}: not saved: {e}")
        self.stats.compile_s += time.perf_counter() - t0
        return entry


def _atomic_write(path: Path, data: bytes) -> None:
    """Whole files only: another process starting meanwhile reads the old or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
        f.write(data)
    os.replace(f.name, path)


def precompile_dir() -> Path:
    """Inside the compile cache directory in use (per version of our code and torch)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "precompiled"
