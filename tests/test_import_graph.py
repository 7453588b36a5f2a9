"""No import cycles among the project's own modules (compiled_spec, passes, kernels, capture).

The graph is read from the source with ``ast``, nothing is imported. What counts as an edge:

* every ``import`` / ``from ... import`` of a project module, at module level *or inside a
  function*: a lazy import only defers the cost, the two modules still depend on each other, so
  a circle through one is a design circle all the same;
* ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``
  (its ``__init__``); ``import a.b.c`` points at ``a.b.c``;
* not imports under ``if TYPE_CHECKING:`` (annotations only, never run);
* not the implicit import of a module's parent packages (``compiled_spec.engine.engine`` runs
  ``compiled_spec/__init__.py`` first): that edge is Python's, not the design's, and would tie
  every module to its package's facade.

The test fails listing every strongly connected component of more than one module, with the
edges inside it, so the circle can be read off the message.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("compiled_spec", "passes", "kernels", "capture")


def project_modules(root: Path = ROOT, packages=PACKAGES) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package ``__init__``)."""
    mods = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node, skipping the bodies of ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def import_graph(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    def owner(name: str) -> str | None:  # the longest project module that ``name`` names
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        package = mod if is_pkg else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            for t in targets:
                dep = owner(t)
                if dep is not None and dep != mod:
                    graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_no_import_cycles():
    graph = import_graph(project_modules())
    assert len(graph) > 50, "the project's modules were not found"
    report = []
    for comp in cycles(graph):
        edges = [f"  {m} -> {', '.join(sorted(graph[m] & set(comp)))}" for m in comp]
        report.append(f"import cycle of {len(comp)} modules:\n" + "\n".join(edges))
    assert not report, "\n".join(report)


def test_cycle_finder_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from p import a\nimport p.sub.b\n")
    graph = import_graph(project_modules(tmp_path, ("p",)))
    assert graph["p.a"] == {"p.sub.b"} and graph["p.sub.b"] == {"p.a"}
    assert graph["p.c"] == {"p.sub.b"}  # the TYPE_CHECKING import is not an edge
    assert cycles(graph) == [["p.a", "p.sub.b"]]
