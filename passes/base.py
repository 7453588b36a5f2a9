"""``GraphPass``: the base class of our FX passes.

A pass modifies a ``torch.fx.GraphModule`` in place, counts what it matched (``match_count``,
reset on every call) and has a ``uuid()`` that is stable across processes and changes whenever
the pass's source or configuration changes. The pipeline folds these uuids into Inductor's FX
graph cache key (as vLLM's ``InductorPass.hash_source`` does), so editing a pass never serves a
stale compiled artifact from the on-disk cache.

Debugging: with ``COMPILED_SPEC_DUMP_GRAPHS=<dir>`` every pass writes the graph before and after
it to ``<dir>/<pid>-<seq>-<pass>-{before,after}.py``; with ``keep_graphs=True`` the same text is
kept in ``last_before`` / ``last_after``. With neither, no graph is ever printed (printing a
graph costs milliseconds per pass, which adds up over recompiles).
"""
from __future__ import annotations

import hashlib
import inspect
import itertools
import json
import os
import sys
from typing import Any

import torch.fx as fx

DUMP_ENV = "COMPILED_SPEC_DUMP_GRAPHS"
_dump_seq = itertools.count()  # orders dump files of one process


def hash_source(*objs: Any) -> str:
    """sha256 over the source of each object's defining module (classes/functions) or the
    string itself. Whole modules, not just the class body: a pass's behaviour also depends on the
    helpers next to it. Falls back to the qualified name where no source is available."""
    hasher = hashlib.sha256()
    for obj in objs:
        if isinstance(obj, str):
            text = obj
        else:
            module = obj if inspect.ismodule(obj) else \
                sys.modules.get(getattr(obj, "__module__", ""), None)
            try:
                text = inspect.getsource(module) if module is not None else inspect.getsource(obj)
            except (OSError, TypeError):
                text = f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', obj)}"
        hasher.update(text.encode("utf-8"))
        hasher.update(b"\0")
    return hasher.hexdigest()


def graph_text(gm: fx.GraphModule) -> str:
    """Readable code of ``gm`` with shapes, for dumps."""
    try:
        return gm.print_readable(print_output=False, include_stride=False, include_device=True)
    except Exception:  # exotic meta (opaque objects) must never break compilation
        return gm.code


class GraphPass:
    """Base class: subclasses implement ``apply(gm) -> int`` (number of matches) and, when they
    take options, ``config()`` (JSON-serialisable; part of ``uuid``)."""

    name: str = ""
    # Modules besides the class hierarchy's whose source is part of uuid(): the shared helpers
    # (which ops count as views, how args are read) change what every pass matches.
    uuid_modules: tuple[str, ...] = ("passes.graph_utils",)

    def __init__(self, keep_graphs: bool = False) -> None:
        self.keep_graphs = keep_graphs
        self.match_count = 0
        self.last_before: str | None = None
        self.last_after: str | None = None
        if not self.name:
            self.name = type(self).__name__

    # --- to override ------------------------------------------------------------------------
    def apply(self, gm: fx.GraphModule) -> int:
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        return {}

    def details(self) -> dict[str, Any]:
        """What the last call did beyond ``match_count`` (for stats); JSON-serialisable."""
        return {}

    # --- identity ---------------------------------------------------------------------------
    def uuid(self) -> str:
        """Stable across processes: source of every module in the class hierarchy (minus
        builtins) and of ``uuid_modules`` + the config, so an edited pass or helper, a subclass
        or a changed option gets a new id."""
        classes = [c for c in type(self).__mro__ if c.__module__ != "builtins"]
        deps = [sys.modules[m] for m in self.uuid_modules if m in sys.modules]
        src = hash_source(*classes, *deps)
        cfg = json.dumps(self.config(), sort_keys=True, default=str)
        return hashlib.sha256(f"{self.name}|{src}|{cfg}".encode()).hexdigest()

    # --- running ----------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule) -> None:
        dump_dir = os.environ.get(DUMP_ENV) or None
        want_text = self.keep_graphs or dump_dir is not None
        before = graph_text(gm) if want_text else None
        self.match_count = int(self.apply(gm))
        if self.match_count:
            gm.graph.lint()
            gm.recompile()
        if want_text:
            after = graph_text(gm)
            if self.keep_graphs:
                self.last_before, self.last_after = before, after
            if dump_dir is not None:
                self._dump(dump_dir, before or "", after)

    def _dump(self, directory: str, before: str, after: str) -> None:
        os.makedirs(directory, exist_ok=True)
        stem = os.path.join(directory, f"{os.getpid()}-{next(_dump_seq):04d}-{self.name}")
        header = f"# {self.name}: {self.match_count} match(es)\n"
        for tag, text in (("before", before), ("after", after)):
            with open(f"{stem}-{tag}.py", "w") as f:
                f.write(header + text)

    def __repr__(self) -> str:
        cfg = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{self.name}({cfg})"
