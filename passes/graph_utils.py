"""Small FX helpers shared by the passes: node values, op matching, view-chain tracing.

Our passes run on the graph Dynamo hands to the backend (torch-level: ``torch.cat``,
``torch._C._nn.linear``, ``call_method`` views) but the helpers also understand aten-level graphs
(``make_fx`` / post-grad), so a pass written against them works at either level.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

import kernels.ops  # noqa: F401  (registers torch.ops.compiled_spec.*)

aten = torch.ops.aten
PAGED_ATTENTION = torch.ops.compiled_spec.paged_attention
WRITE_KV = torch.ops.compiled_spec.write_kv
# write_kv with the rope of q and k inside (same k_cache / v_cache / slot_mapping positions)
ROPE_WRITE_KV = torch.ops.compiled_spec.rope_write_kv
# ... and with the qkv projection too (passes.skinny_gemm; same positions again)
QKV_ROPE_WRITE_KV = torch.ops.compiled_spec.qkv_rope_write_kv
KV_WRITES = (WRITE_KV, ROPE_WRITE_KV, QKV_ROPE_WRITE_KV)

# Placeholder meta key the backend uses to remember where each graph input comes from
# (an ``InputSpec`` from passes.pipeline); passes copy it along when they move placeholders.
INPUT_SPEC_KEY = "compiled_spec_input"

# Ops that return their input or a view of it (no new storage, no compute). Used both to trace a
# value back to the graph input it came from and as the set NoOpElimination may remove.
VIEW_METHODS = frozenset({
    "view", "reshape", "contiguous", "to", "float", "half", "bfloat16", "double", "int", "long",
    "type_as", "expand", "expand_as", "flatten", "view_as", "reshape_as", "t", "transpose",
    "permute", "squeeze", "unsqueeze", "narrow", "detach",
})
VIEW_FUNCTIONS = frozenset({
    torch.reshape, torch.flatten, torch.t, torch.transpose, torch.permute, torch.squeeze,
    torch.unsqueeze, torch.narrow, torch.detach, operator.getitem,
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
    aten.slice.Tensor, aten.t.default, aten.transpose.int, aten.permute.default,
    aten.squeeze.dim, aten.unsqueeze.default, aten.expand.default, aten.contiguous.default,
    aten.detach.default,
})
# Same-value copies: fine when tracing where a value came from, never "no-ops" (new storage).
COPY_FUNCTIONS = frozenset({aten.clone.default, aten._to_copy.default, torch.clone})


def node_val(node: Any) -> Any:
    """The fake value of a node: ``val`` (aot/make_fx graphs) or ``example_value`` (Dynamo)."""
    if not isinstance(node, fx.Node):
        return node
    meta = node.meta
    return meta["val"] if "val" in meta else meta.get("example_value")


def is_op(node: Any, *ops: Any) -> bool:
    """True when ``node`` calls one of ``ops`` (an OpOverloadPacket matches all its overloads)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    target = node.target
    return target in ops or getattr(target, "overloadpacket", None) in ops


def is_view_like(node: fx.Node, allow_copies: bool = True) -> bool:
    """Whether ``node`` only re-describes its first argument (views, casts; with
    ``allow_copies`` also same-value copies such as ``clone``)."""
    if node.op == "call_method":
        return node.target in VIEW_METHODS or (allow_copies and node.target == "clone")
    if node.op == "call_function":
        return node.target in VIEW_FUNCTIONS or (allow_copies and node.target in COPY_FUNCTIONS)
    return False


def get_arg(node: fx.Node, index: int, name: str) -> Any:
    """Argument ``name`` of a call, passed positionally at ``index`` or by keyword."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name)


def set_arg(node: fx.Node, index: int, name: str, value: Any) -> None:
    if len(node.args) > index:
        args = list(node.args)
        args[index] = value
        node.args = tuple(args)
    else:
        kwargs = dict(node.kwargs)
        kwargs[name] = value
        node.kwargs = kwargs


def trace_to_root(value: Any) -> tuple[Any, list[fx.Node]]:
    """Follow ``value`` back through view-like nodes to the node that produced its storage.
    Returns (root, chain) where chain lists the view nodes from the root's user down to
    ``value`` (empty when ``value`` is itself the root or not a node)."""
    chain: list[fx.Node] = []
    while isinstance(value, fx.Node) and is_view_like(value) and value.args \
            and isinstance(value.args[0], fx.Node):
        chain.append(value)
        value = value.args[0]
    chain.reverse()
    return value, chain


def source_name(node: Any) -> str | None:
    """Dynamo's source expression for a placeholder (e.g. ``L['metas']['layers.0'].seq_lens``)
    or the attribute path of a ``get_attr``; None when the graph did not record one."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "get_attr":
        return str(node.target)
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else name


_MODULE_PATH = re.compile(r"_modules\['([^']+)'\]")


def module_path(node: Any) -> str | None:
    """Dotted module path of a parameter/buffer input: ``d.layers.0.self_attn`` for Dynamo's
    ``L['self']._modules['d']._modules['layers']._modules['0']...._buffers['k_cache']``."""
    name = source_name(node)
    if name is None:
        return None
    if node.op == "get_attr":
        return name.rsplit(".", 1)[0] if "." in name else ""
    parts = _MODULE_PATH.findall(name)
    return ".".join(parts) if parts else None


def same_size(a: Iterable[Any], b: Iterable[Any]) -> bool:
    """Sizes/strides provably equal, without adding guards to the shape environment."""
    a, b = list(a), list(b)
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def count_ops(gm: fx.GraphModule, *ops: Any) -> int:
    return sum(1 for n in gm.graph.nodes if is_op(n, *ops))


@dataclass(frozen=True)
class InputSpec:
    """Where the backend takes a (transformed) graph input from at call time.

    kind "arg": ``args[index]`` of the call Dynamo makes; "hoisted": output ``index`` of the
    hoisted eager part (HoistEagle3Fc); "layer_meta": field ``field`` of the metadata bound for
    ``layer`` (BindPerLayerAttnMetadata), else the ``fallback`` input (the shared one)."""

    kind: str
    index: int = -1
    layer: str = ""
    field: str = ""
    fallback: "InputSpec | None" = None


def fresh_fake(val: Any) -> Any:
    """A new fake tensor with ``val``'s (possibly symbolic) sizes/strides/dtype/device, in
    ``val``'s fake mode: distinct storage, so AOT autograd never treats two inputs as aliases."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return val
    with mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
