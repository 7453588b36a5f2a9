"""``NoOpElimination``: drop views, casts and slices that provably return their input unchanged.

Model code is full of them once traced: RMSNorm's ``x.float()`` / ``.to(torch.float32)`` on an fp32
model, ``reshape`` to the shape a tensor already has, ``x[:, :]``, ``.contiguous()`` on contiguous
values. Each is free at run time in eager mode but costs a node in every pattern our other passes
match (a view between ``cat`` and ``linear`` hides the EAGLE-3 fc) and a dispatcher call in
anything run eagerly.

"Provably" means: the op is one that returns its input or a view of its input (``VIEW_METHODS`` /
``VIEW_FUNCTIONS`` in graph_utils: never copies such as ``clone`` or ``aten._to_copy``, never
``detach``), and the node's fake value has exactly the input's dtype, device, shape, strides and
storage offset, all compared with ``statically_known_true`` so no symbolic shape guard is added
(an unknown comparison keeps the node). Such a view aliases the same bytes with the same
metadata, so every user sees the same values. Kept regardless:

- nodes whose fake value is missing (graphs traced without shape propagation);
- ``.to(..., copy=True)`` and indexing with anything but full slices / ``...``;
- nodes whose result is mutated in a metadata-changing way (``t_``, ``resize_``, ...), where the
  view's identity matters;
- a graph output that would become a graph input itself (the caller could observe ``out is x``).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from passes.base import GraphPass
from passes.graph_utils import VIEW_FUNCTIONS, VIEW_METHODS, node_val, same_size

_METADATA_MUTATING = frozenset({
    "t_", "transpose_", "resize_", "resize_as_", "squeeze_", "unsqueeze_", "as_strided_",
    "set_", "swapdims_", "swapaxes_", "requires_grad_",
})
_NEVER = frozenset({"detach", torch.detach, torch.ops.aten.detach.default})


def _is_full_index(index: Any) -> bool:
    """``x[:]``, ``x[..., :]``, ``x[:, :]``: only slices / Ellipsis (shape checks do the rest)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(i is Ellipsis or isinstance(i, slice) for i in items)


def _candidate(node: fx.Node) -> bool:
    if not node.args or not isinstance(node.args[0], fx.Node) or node.target in _NEVER:
        return False
    if node.op == "call_method":
        if node.target not in VIEW_METHODS:
            return False
        return not (node.target == "to" and node.kwargs.get("copy", False))
    if node.op != "call_function" or node.target not in VIEW_FUNCTIONS:
        return False
    if node.target is operator.getitem:
        return len(node.args) == 2 and _is_full_index(node.args[1])
    return True


def _same_tensor_view(out: Any, inp: Any) -> bool:
    if not (isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor)):
        return False
    if out.dtype != inp.dtype or out.device != inp.device or out.layout != inp.layout:
        return False
    if out.layout != torch.strided or out.requires_grad != inp.requires_grad:
        return False
    return (same_size(out.shape, inp.shape) and same_size(out.stride(), inp.stride())
            and same_size([out.storage_offset()], [inp.storage_offset()]))


class NoOpElimination(GraphPass):
    def apply(self, gm: fx.GraphModule) -> int:
        removed = 0
        for node in list(gm.graph.nodes):
            if not _candidate(node):
                continue
            src = node.args[0]
            if not _same_tensor_view(node_val(node), node_val(src)):
                continue
            if any(u.op == "call_method" and u.target in _METADATA_MUTATING for u in node.users):
                continue
            if src.op == "placeholder" and any(u.op == "output" for u in node.users):
                continue
            inputs = node.all_input_nodes
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            removed += 1
            # Size computations that only fed the removed view (``x.size(0)`` for a reshape):
            # pure and now unused; only these, never a general DCE (write_kv returns nothing
            # and would look dead).
            for n in inputs:
                if n is not src and not n.users and n.op in ("call_function", "call_method") \
                        and not n.is_impure():
                    gm.graph.erase_node(n)
        return removed
