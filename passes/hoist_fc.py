"""``HoistEagle3Fc``: move EAGLE-3's aux-state fusion ``fc(cat(aux_0, aux_1, aux_2))`` out of the
compiled graph.

Why: the fc consumes the target's aux hidden states, which exist only for the first draft pass
and cover a variable number of tokens (every accepted token of every sequence); every later draft
step feeds back one fixed-size hidden per sequence. Inside the graph, the fc would tie the whole
draft forward to the first pass's token count, so the fixed-shape steps could not share one CUDA
graph (vLLM PR "Apply torch.compile & cudagraph to EAGLE3", seed 003: moving the fc out took
propose from ~16 ms to ~6 ms; the fc is one ``aten::mm``, cheap in eager mode). The same thread's
acceptance drop (3.52 -> 2.79) came from the compiled remainder never being captured, which is
why the backend keeps the hoisted part strictly outside anything ``wrap_compiled`` captures.

Level: the Dynamo graph (torch functions, before AOT autograd). The split produces two callables,
which only makes sense before AOT/Inductor take the graph over; there is no functionalization or
decomposition to see through yet, and parameters are plain placeholders. The matcher also accepts
aten-level spellings (``aten.cat`` + ``aten.linear`` / ``aten.mm`` / ``aten.addmm``) and
``call_module`` Linear layers, so it works on make_fx graphs and non-inlined modules too.

Match: a projection (linear / mm / addmm / matmul / nn.Linear module) whose input is a
``cat`` along the last dim of >= 2 tensors, where every tensor in its backward closure comes from
graph inputs through view-like ops only (views, casts, full slices), weights included. So
EAGLE-1's ``fc(cat(embed(ids), hidden))`` (an embedding lookup inside) is left in the graph: it
runs on the per-step shapes anyway. Graphs without a match are untouched (``match_count`` 0).

Rewrite (in place): the closure is copied into a new GraphModule returning a tuple of the
projections (``gm.meta[HOISTED_KEY]``, a ``HoistedPart``); in ``gm`` each projection is replaced
by a new placeholder (tagged ``InputSpec("hoisted", k)``, fake value of the projection) and the
now-dead closure, including inputs only it used (aux states, fc weight), is erased. The backend
then calls the hoisted module eagerly with the original inputs and passes its outputs into the
compiled remainder.
"""
from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from passes.base import GraphPass
from passes.graph_utils import (INPUT_SPEC_KEY, InputSpec, is_op, is_view_like, node_val,
                                trace_to_root)

aten = torch.ops.aten
HOISTED_KEY = "compiled_spec_hoisted"
_CAT_FUNCTIONS = (torch.cat, torch.concat, torch.concatenate)
_LINEAR_FUNCTIONS = (torch._C._nn.linear, F.linear)


@dataclass
class HoistedPart:
    """The eager prologue split off a graph: ``module(*inputs)`` returns a tuple whose k-th item
    feeds the remainder's placeholder tagged ``InputSpec("hoisted", k)``."""

    module: fx.GraphModule
    inputs: list[Any] = field(default_factory=list)  # per placeholder: its InputSpec (or name)


def _cat_of(node: Any) -> fx.Node | None:
    """``node`` if it concatenates >= 2 tensors along the last dim, else None."""
    if not isinstance(node, fx.Node):
        return None
    if not (node.op == "call_function" and node.target in _CAT_FUNCTIONS) and \
            not is_op(node, aten.cat):
        return None
    tensors = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or len(tensors) < 2 or not isinstance(dim, int):
        return None
    val = node_val(node)
    ndim = val.dim() if isinstance(val, torch.Tensor) else None
    return node if dim == -1 or (ndim is not None and dim == ndim - 1) else None


def _projection_input(gm: fx.GraphModule, node: fx.Node) -> tuple[Any, list[Any]] | None:
    """(activation input, weight-side inputs) of a projection node, or None."""
    if node.op == "call_function":
        if node.target in _LINEAR_FUNCTIONS or is_op(node, aten.linear):
            return node.args[0] if node.args else None, list(node.args[1:]) + \
                list(node.kwargs.values())
        if is_op(node, aten.mm) or node.target in (torch.matmul, operator.matmul):
            return node.args[0], list(node.args[1:])
        if is_op(node, aten.addmm):
            return node.args[1], [node.args[0], node.args[2]]
        return None
    if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.Linear):
        return node.args[0], []
    return None


def _closure(node: fx.Node, stop: fx.Node) -> set[fx.Node] | None:
    """Nodes ``node`` depends on, if they are all inputs or view-like (``stop`` is accepted as
    the single non-view op on the way); None if anything else (real compute) is involved."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            continue
        if n is not stop and n is not node and not is_view_like(n):
            return None
        stack.extend(n.all_input_nodes)
    return seen


class HoistEagle3Fc(GraphPass):
    def __init__(self, keep_graphs: bool = False, max_matches: int = 1) -> None:
        super().__init__(keep_graphs)
        self.max_matches = max_matches  # an EAGLE-3 draft has one fc; more is suspicious

    def config(self) -> dict[str, Any]:
        return {"max_matches": self.max_matches}

    def find(self, gm: fx.GraphModule) -> list[tuple[fx.Node, set[fx.Node]]]:
        found: list[tuple[fx.Node, set[fx.Node]]] = []
        for node in gm.graph.nodes:
            proj = _projection_input(gm, node)
            if proj is None:
                continue
            act, weights = proj
            cat = _cat_of(act)
            if cat is None:
                continue
            closure = _closure(node, stop=cat)
            if closure is None:  # something computed feeds the cat or the weights
                continue
            tensors = cat.args[0] if cat.args else cat.kwargs["tensors"]
            if not all(trace_to_root(t)[0].op == "placeholder" for t in tensors
                       if isinstance(t, fx.Node)):
                continue
            found.append((node, closure))
            if len(found) == self.max_matches:
                break
        return found

    def apply(self, gm: fx.GraphModule) -> int:
        found = self.find(gm)
        if not found:
            return 0
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        closure = sorted(set().union(*(c for _, c in found)), key=order.__getitem__)

        # 1. Copy the closure into its own graph (placeholders keep meta, incl. InputSpec tags).
        hoisted = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for n in closure:
            if n.op == "placeholder":
                env[n] = hoisted.placeholder(n.name)
                env[n].meta = copy.copy(n.meta)
            else:
                env[n] = hoisted.node_copy(n, env.__getitem__)
        hoisted.output(tuple(env[proj] for proj, _ in found))
        module = fx.GraphModule(gm, hoisted, class_name="HoistedFc")
        inputs = [p.meta.get(INPUT_SPEC_KEY, p.name) for p in hoisted.nodes
                  if p.op == "placeholder"]

        # 2. Replace each projection in gm by a new input.
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        for k, (proj, _) in enumerate(found):
            with graph.inserting_after(last):
                ph = graph.placeholder(f"hoisted_fc_{k}")
            for key in ("val", "example_value", "tensor_meta"):
                if key in proj.meta:
                    ph.meta[key] = proj.meta[key]
            ph.meta[INPUT_SPEC_KEY] = InputSpec("hoisted", k)
            proj.replace_all_uses_with(ph)
            last = ph

        # 3. Erase what only the hoisted part used: closure nodes (reverse order, so users go
        #    first) and tensor inputs left without users. SymInt inputs stay: they still bind
        #    shape symbols (e.g. the token count) used by the remainder.
        for n in reversed(closure):
            if n.users:
                continue
            if n.op == "placeholder" and not isinstance(node_val(n), torch.Tensor):
                continue
            graph.erase_node(n)
        gm.meta[HOISTED_KEY] = HoistedPart(module, inputs)
        return len(found)
