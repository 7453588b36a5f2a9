"""``BindPerLayerAttnMetadata``: every draft layer's attention reads its own layer's metadata.

Why (seed 004): multi-layer EAGLE drafts first shipped with one AttentionMetadata shared by all
draft layers, which is only right while every layer has the same KV layout and block allocation.
Our EagleDraft takes ``attn_metas: dict[str, AttentionMetadata]`` keyed ``"layers.i"``, so the
engine may lay out each layer's cache differently; this pass makes sure the compiled graph keeps
that binding, and gives the same ability to models written the "global context" way.

Mechanics (on the Dynamo graph; aten graphs work too, minus source-based checks):

1. Layers. ``paged_attention`` / ``write_kv`` (or ``rope_write_kv``) nodes are grouped by the
   k_cache input they read (traced through views to a placeholder / get_attr). A layer's name
   comes from the cache's module path (``...layers.3.self_attn`` -> ``"layers.3"``), else
   ``"layers.<ordinal>"``.
2. Layout check. All layers' k/v caches must agree on page size, num_kv_heads, head_dim (dims
   1..3 of ``[num_blocks, page_size, kv_heads, head_dim]``), dtype and device, read from the
   nodes' fake values; a provable mismatch raises ValueError naming the layers and shapes (one
   draft KV pool, one layout; num_blocks may differ).
3. Metadata roots. A layer's metadata fields (write_kv: slot_mapping; paged_attention:
   block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len) are traced through
   views to their root nodes. Sharing is decided on the layout fields (slot_mapping,
   block_tables): the others describe the batch (same tokens, same sequences in every layer) and
   may be one tensor for all layers.
   - Layout roots disjoint across layers -> already per-layer: verified. When Dynamo recorded the
     sources (``L['attn_metas']['layers.0'].slot_mapping``) and they name one metadata object
     whose key is one of the graph's layers, it must be this layer's (``layers.1`` reading
     ``attn_metas['layers.0']`` raises ValueError). One match per layer.
   - Shared by several layers -> rewritten (``rewrite_shared=True``). Note Dynamo de-duplicates
     one tensor object reached through several names, so ``{name: meta for name in layers}``
     (one object for every layer, as the proposer passes today) also reads as shared, whatever
     the model code looks like; the rewrite then adds the per-layer inputs. Each such layer
     gets new placeholders ``<layer>__<field>`` for the tensor fields (slot_mapping,
     block_tables, seq_lens, query_start_loc), tagged ``InputSpec("layer_meta", layer=,
     field=, fallback=<shared input>)``; any view chain between the shared input and the op is
     copied per layer. seq_lens and query_start_loc are included so that bound metadata is
     honoured as a whole; the host-side ints max_query_len / max_seq_len stay shared (new
     symbolic ints would need new shape symbols, and they bound the batch, not a layout). One
     match per rewritten layer. At run time the backend fills these inputs from metadata bound
     per layer (``CompiledSpecBackend.bind_layer_metadata``), else passes the shared value, so
     an unbound call computes exactly what the model code does. Fields whose root is not a
     graph input (computed in-graph) stay shared.
   With ``rewrite_shared=False`` shared layers are left alone and not counted.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from passes.base import GraphPass
from passes.graph_utils import (INPUT_SPEC_KEY, KV_WRITES, PAGED_ATTENTION, InputSpec, fresh_fake,
                                get_arg, is_op, module_path, node_val, set_arg, source_name,
                                trace_to_root)

# (op, positional index, schema name) of every metadata argument; True = per-layer tensor field.
_WRITE_FIELDS = (("slot_mapping", 4, True),)
_ATTN_FIELDS = (("block_tables", 3, True), ("seq_lens", 4, True), ("query_start_loc", 5, True),
                ("max_query_len", 6, False), ("max_seq_len", 7, False))
_LAYOUT_FIELDS = frozenset({"slot_mapping", "block_tables"})  # differ with the cache layout
_LAYER_RE = re.compile(r"(?:^|\.)(layers\.\d+)(?:\.|$)")
_KEY_RE = re.compile(r"^(.*)\.(\w+)$")
_SUBSCRIPT_RE = re.compile(r"\[['\"]([^'\"]+)['\"]\]$")


@dataclass
class _Layer:
    name: str
    k_cache: fx.Node
    v_cache: Any
    ops: list[tuple[fx.Node, tuple[tuple[str, int, bool], ...]]]

    def uses(self) -> list[tuple[fx.Node, str, int, bool, Any]]:
        """(op node, field, index, per-layer tensor field?, argument) for every metadata arg."""
        return [(node, f, i, t, get_arg(node, i, f)) for node, fields in self.ops
                for f, i, t in fields]


def _layers(gm: fx.GraphModule) -> list[_Layer]:
    layers: dict[fx.Node, _Layer] = {}
    for node in gm.graph.nodes:
        if is_op(node, PAGED_ATTENTION):
            k, v, fields = get_arg(node, 1, "k_cache"), get_arg(node, 2, "v_cache"), _ATTN_FIELDS
        elif is_op(node, *KV_WRITES):
            k, v, fields = get_arg(node, 2, "k_cache"), get_arg(node, 3, "v_cache"), _WRITE_FIELDS
        else:
            continue
        root = trace_to_root(k)[0]
        if root not in layers:
            path = module_path(root) or ""
            m = _LAYER_RE.findall(path)
            layers[root] = _Layer(m[-1] if m else f"layers.{len(layers)}", k, v, [])
        layers[root].ops.append((node, fields))
    names = [layer.name for layer in layers.values()]
    if len(set(names)) != len(names):  # e.g. two stacks both named layers.N: fall back to order
        for i, layer in enumerate(layers.values()):
            layer.name = f"layers.{i}"
    return list(layers.values())


def _check_layouts(layers: list[_Layer]) -> None:
    ref = None
    for layer in layers:
        for which, cache in (("k_cache", layer.k_cache), ("v_cache", layer.v_cache)):
            val = node_val(cache)
            if not isinstance(val, torch.Tensor):
                continue
            desc = (tuple(val.shape), val.dtype, val.device)
            if ref is None:
                ref = (layer.name, which, desc)
                continue
            ref_shape, ref_dtype, ref_dev = ref[2]
            differs = (val.dim() != len(ref_shape) or val.dtype != ref_dtype
                       or val.device != ref_dev
                       or any(statically_known_true(a != b)
                              for a, b in zip(val.shape[1:], ref_shape[1:])))
            if differs:
                raise ValueError(
                    f"draft layers need different KV layouts: {layer.name} {which} is "
                    f"{list(desc[0])} {val.dtype} on {val.device} but {ref[0]} {ref[1]} is "
                    f"{list(ref_shape)} {ref_dtype} on {ref_dev}; all draft layers must share "
                    "[*, page_size, num_kv_heads, head_dim], dtype and device")


def _metadata_key(roots: list[fx.Node]) -> tuple[str | None, str | None]:
    """(metadata object source, its last string subscript) when all roots come from one
    object (``L['m']['layers.0'].x`` -> ``("L['m']['layers.0']", "layers.0")``)."""
    bases = set()
    for r in roots:
        name = source_name(r)
        m = _KEY_RE.match(name) if name else None
        if m is None:
            return None, None
        bases.add(m.group(1))
    if len(bases) != 1:  # fields gathered from several objects: nothing to check by key
        return None, None
    base = bases.pop()
    sub = _SUBSCRIPT_RE.search(base)
    return base, sub.group(1) if sub else None


class BindPerLayerAttnMetadata(GraphPass):
    def __init__(self, keep_graphs: bool = False, rewrite_shared: bool = True) -> None:
        super().__init__(keep_graphs)
        self.rewrite_shared = rewrite_shared
        self.verified: list[str] = []  # layers of the last call, per outcome
        self.rewritten: list[str] = []

    def config(self) -> dict[str, Any]:
        return {"rewrite_shared": self.rewrite_shared}

    def details(self) -> dict[str, Any]:
        return {"verified": list(self.verified), "rewritten": list(self.rewritten)}

    def apply(self, gm: fx.GraphModule) -> int:
        self.verified, self.rewritten = [], []
        layers = _layers(gm)
        if not layers:
            return 0
        _check_layouts(layers)
        # Sharing is judged on the layout fields only: seq_lens / query_start_loc / the bounds
        # describe the batch and may legitimately be one tensor for all layers.
        roots = {layer.name: {trace_to_root(a)[0] for _, f, _, _, a in layer.uses()
                              if f in _LAYOUT_FIELDS and isinstance(a, fx.Node)}
                 for layer in layers}
        names = {layer.name for layer in layers}
        shared: list[_Layer] = []
        for layer in layers:
            others = set().union(*(r for n, r in roots.items() if n != layer.name))
            if roots[layer.name] & others:
                shared.append(layer)
                continue
            _, key = _metadata_key(sorted(roots[layer.name], key=lambda n: n.name))
            if key is not None and key in names and key != layer.name:
                raise ValueError(f"attention of draft layer {layer.name!r} reads the metadata "
                                 f"of {key!r}; each layer must read its own")
            self.verified.append(layer.name)
        if shared and self.rewrite_shared:
            for layer in shared:
                if self._rewrite(gm, layer):
                    self.rewritten.append(layer.name)
        return len(self.verified) + len(self.rewritten)

    def _rewrite(self, gm: fx.GraphModule, layer: _Layer) -> bool:
        graph = gm.graph
        new_inputs: dict[tuple[fx.Node, str], fx.Node] = {}  # (shared root, field) -> placeholder
        changed = False
        for node, fname, index, per_layer, arg in layer.uses():
            if not per_layer or not isinstance(arg, fx.Node):
                continue
            root, chain = trace_to_root(arg)
            if root.op != "placeholder":
                continue  # computed in-graph: nothing to bind from outside
            ph = new_inputs.get((root, fname))
            if ph is None:
                last = [n for n in graph.nodes if n.op == "placeholder"][-1]
                with graph.inserting_after(last):
                    ph = graph.placeholder(f"{layer.name.replace('.', '_')}__{fname}")
                val = node_val(root)
                if val is not None:
                    ph.meta["example_value"] = fresh_fake(val)
                fallback = root.meta.get(INPUT_SPEC_KEY)
                ph.meta[INPUT_SPEC_KEY] = InputSpec("layer_meta", layer=layer.name, field=fname,
                                                    fallback=fallback)
                new_inputs[(root, fname)] = ph
            value = ph
            with graph.inserting_before(node):  # per-layer copy of the view chain
                for view in chain:
                    value = graph.node_copy(view, lambda a, v=view, cur=value:
                                            cur if a is v.args[0] else a)
            set_arg(node, index, fname, value)
            changed = True
        return changed
