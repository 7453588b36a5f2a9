"""``SkinnyGemmFusion``: rewrite the decoder's norm / activation / residual around each linear
into fused skinny-GEMM ops (``kernels.gemm_ops``), single Triton launches at decode sizes.

On Dynamo's graph (torch level) of ``compiled_spec.models``:
  r + linear(...) (the linear's only user)  => skinny_linear(x, W, residual=r), or with a norm:
  RMSNorm -> linear                          => compiled_spec::rmsnorm_linear(x, w_norm, eps, W)
  [RMSNorm ->] linear(gate_up) -> chunk(2) -> silu(g) * u
                                             => compiled_spec::gated_linear(x, w_norm, eps, W)
  [RMSNorm ->] linear(qkv) -> view as heads -> [:, :h + kvh], [:, h + kvh:] -> rope_write_kv
                                             => compiled_spec::qkv_rope_write_kv(x, W, caches,
                                                slot_mapping, cos, sin, h, w_norm, eps)
By default only the residual epilogues are fused: o_proj and down become
``skinny_linear(x, W, residual=r)`` and the norms and SiLU-and-mul stay Inductor's kernels in
front of cuBLAS. ``layer=True`` also folds gate_up's SiLU-and-mul and qkv's rope + KV write into
their GEMMs: a decoder layer is then 8 kernels instead of 10 (per layer: two RMSNorms, qkv +
rope + KV write, attention and its split merge, o_proj + residual, gate_up + SiLU-and-mul,
down + residual). ``norms=True`` folds the RMSNorms into the GEMM after them as well (6
kernels), which measured slower on the H200 (twenty-ninth session, CUDA-graph replay, L2-cold
weights, M = 1): the norm costs the GEMM 2.6-3.5 us against the separate norm kernel's ~1 us
(qkv + rope + KV write 4.71 us without the norm, 7.30-8.25 with it, 6.38 unfused), while the
epilogues win (qkv + rope + KV write 4.71 vs 5.41 for cuBLAS + the rope kernel, gate_up +
SiLU-and-mul 4.57 vs 5.40 for cuBLAS + Inductor's kernel). The ops compute exactly the
unfused ops where the Triton kernels do not run (CPU; more than ``MAX_M`` rows on the GPU, i.e.
prefill), so only the GPU's bf16 rounding inside the kernels differs. Off by default
(``CompileConfig.skinny_gemm``) until measured end to end.

RMSNorm as traced: ``h = x.float(); w * (h * rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
.to(x.dtype)``; the casts may be gone (NoOpElimination on an fp32 model), so values are
compared after stripping view-like nodes, and dtypes are checked on the fake values. eps must be
a Python number (the engine compiles with ``specialize_float``); a traced ``eps.item()`` is left
alone. Linears with a bias, and values that are not 2-D, are left alone.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from passes.base import GraphPass
from passes.graph_utils import (ROPE_WRITE_KV, get_arg, is_op, node_val, same_size,
                                trace_to_root)

OPS = torch.ops.compiled_spec
_LINEAR = (torch._C._nn.linear, F.linear)
_MUL = (operator.mul, torch.mul)
_ADD = (operator.add, torch.add)


def _call(node: Any, fns: tuple, method: str | None = None) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target == method
    return node.op == "call_function" and node.target in fns


def _root(value: Any) -> Any:
    return trace_to_root(value)[0]


def _dtype(value: Any) -> torch.dtype | None:
    val = node_val(value) if isinstance(value, fx.Node) else None
    return getattr(val, "dtype", None)


def _other(node: fx.Node, pred) -> tuple[Any, Any] | None:
    """For a binary node, (the operand satisfying ``pred``, the other one), either order."""
    if len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if pred(a):
        return a, b
    if pred(b):
        return b, a
    return None


def _normalised(value: Any) -> tuple[fx.Node, fx.Node] | None:
    """``value`` (casts stripped) = h * rsqrt(...): (h, the rsqrt node), else None."""
    normed = _root(value)
    if not _call(normed, _MUL) or _dtype(normed) != torch.float32:
        return None
    pair = _other(normed, lambda n: _call(n, (torch.rsqrt,), "rsqrt"))
    return None if pair is None else (pair[1], pair[0])


def match_rmsnorm(value: Any) -> tuple[fx.Node, fx.Node, float] | None:
    """``value`` = RMSNorm(x) = w * (normalised x, cast back to x's dtype): (x, w, eps)."""
    if not _call(value, _MUL) or len(value.args) != 2 or value.kwargs:
        return None
    for cast, weight in (value.args, value.args[::-1]):
        found = _normalised(cast) if isinstance(weight, fx.Node) else None
        if found is not None:
            break
    else:
        return None
    h, rsqrt = found
    add = rsqrt.args[0]
    if not _call(add, _ADD):
        return None
    pair = _other(add, lambda n: _call(n, (torch.mean,), "mean"))
    if pair is None or not isinstance(pair[1], (int, float)) or isinstance(pair[1], bool):
        return None  # a traced eps (``eps.item()``) cannot become the op's float argument
    mean, eps = pair
    dim = get_arg(mean, 1, "dim")
    if dim not in (-1, [-1], (-1,), 1, [1], (1,)) or not mean.kwargs.get("keepdim", False):
        return None
    power = mean.args[0]
    if not (_call(power, (torch.pow,), "pow") and len(power.args) == 2 and power.args[1] == 2):
        return None
    x = _root(h)
    if _root(power.args[0]) is not x:
        return None
    xv, wv = node_val(x), node_val(weight)
    if xv is None or wv is None or xv.dim() != 2 or wv.dim() != 1 or wv.dtype != xv.dtype \
            or _dtype(cast) != xv.dtype:  # the model casts back to x's dtype before w
        return None
    return x, weight, float(eps)


def match_silu_mul(value: Any) -> fx.Node | None:
    """``value`` = silu(gate) * up with (gate, up) = gate_up.chunk(2, -1): gate_up, else None."""
    if not _call(value, _MUL):
        return None
    pair = _other(value, lambda n: _call(n, (F.silu, torch.nn.functional.silu), "silu"))
    if pair is None:
        return None
    gate, up = pair[0].args[0], pair[1]
    if not (is_op(gate, operator.getitem) and is_op(up, operator.getitem)
            and gate.args[0] is up.args[0] and gate.args[1] == 0 and up.args[1] == 1):
        return None
    chunk = gate.args[0]
    if not (_call(chunk, (torch.chunk,), "chunk") and get_arg(chunk, 1, "chunks") == 2):
        return None
    gate_up = chunk.args[0]
    val = node_val(gate_up)
    if val is None or val.dim() != 2 or get_arg(chunk, 2, "dim") not in (-1, 1):
        return None
    return gate_up


def match_gated(lin: fx.Node) -> fx.Node | None:
    """The node ``silu(gate) * up`` when it is all that reads ``lin``'s output (through
    chunk(2, -1), each half read once), else None: the linear is the gated MLP's gate_up."""
    chunk = next(iter(lin.users)) if len(lin.users) == 1 else None
    if chunk is None or len(chunk.users) != 2:
        return None
    halves = list(chunk.users)
    if not all(is_op(h, operator.getitem) and len(h.users) == 1 for h in halves):
        return None
    gate = next((h for h in halves if h.args[1] == 0), None)
    silu = next(iter(gate.users)) if gate is not None else None
    if silu is None or len(silu.users) != 1:
        return None
    mul = next(iter(silu.users))
    if match_silu_mul(mul) is not lin or not all(next(iter(h.users)) in (silu, mul)
                                                 for h in halves):
        return None
    return mul


def _slice_index(node: fx.Node) -> tuple[Any, Any] | None:
    """``x[:, a:b]`` as a getitem: (a, b), else None."""
    if not is_op(node, operator.getitem) or not isinstance(node.args[1], tuple):
        return None
    idx = node.args[1]
    if len(idx) != 2 or idx[0] != slice(None) or not isinstance(idx[1], slice) \
            or idx[1].step not in (None, 1):
        return None
    return idx[1].start, idx[1].stop


def match_qkv_rope(lin: fx.Node) -> fx.Node | None:
    """The ``rope_write_kv`` node fed by the fused qkv projection ``lin`` alone, viewed as
    [T, heads + 2 kv heads, head_dim] and sliced into (q and k, v): the decoder's
    ``_write_qkv``; else None."""
    view = next(iter(lin.users)) if len(lin.users) == 1 else None
    vv = node_val(view) if view is not None else None
    if not isinstance(vv, torch.Tensor) or vv.dim() != 3 or len(view.users) != 2 \
            or not _call(view, (torch.reshape,), "view") and not _call(view, (), "reshape"):
        return None
    first = [n for n in view.users if (_slice_index(n) or (1,))[0] in (None, 0)]
    if len(first) != 1:
        return None
    qk, v = first[0], next(n for n in view.users if n is not first[0])
    rope = next(iter(qk.users)) if len(qk.users) == 1 else None
    if rope is None or not is_op(rope, ROPE_WRITE_KV) or list(v.users) != [rope] \
            or rope.args[:2] != (qk, v):
        return None
    h, split = get_arg(rope, 7, "num_heads"), vv.shape[1]
    kc = node_val(get_arg(rope, 2, "k_cache"))
    if not isinstance(h, int) or kc is None or kc.dim() != 4:
        return None
    kvh = kc.shape[-2]
    if not (same_size([split, vv.shape[2]], [h + 2 * kvh, kc.shape[-1]])
            and _slice_index(qk) in ((None, h + kvh), (0, h + kvh))
            and _slice_index(v) in ((h + kvh, None), (h + kvh, split))):
        return None
    return rope


def _erase_unused(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and then whatever upstream of it is left without users: the unfused chain
    (kept where something else still reads it). Only plain torch calls: never placeholders or
    custom ops (a mutating op such as write_kv has no users by design)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if getattr(n, "_erased", False) or n.users or n.op not in ("call_function",
                                                                    "call_method"):
            continue
        target = n.target
        if isinstance(target, torch._ops.OpOverloadPacket):
            target = getattr(target, "default", None)
        if isinstance(target, torch._ops.OpOverload) and (
                target.namespace == "compiled_spec" or target._schema.is_mutable):
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        stack += inputs


class SkinnyGemmFusion(GraphPass):
    """Each rewritten linear counts once (its norm, gating, rope or residual fold into the same
    node). ``layer``: gate_up's SiLU-and-mul and qkv's rope + KV write fold in too; ``norms``:
    the RMSNorms before the GEMMs as well (see the module docstring)."""

    def __init__(self, keep_graphs: bool = False, layer: bool = False,
                 norms: bool = False) -> None:
        super().__init__(keep_graphs)
        self.layer = layer
        self.norms = norms
        self._kinds: dict[str, int] = {}

    def config(self) -> dict[str, Any]:
        return {"layer": self.layer, "norms": self.norms}

    def details(self) -> dict[str, Any]:
        return dict(self._kinds)

    def apply(self, gm: fx.GraphModule) -> int:
        self._kinds = {"rmsnorm": 0, "gated": 0, "residual": 0, "rope_kv": 0}
        graph = gm.graph
        count = 0
        for lin in list(graph.nodes):
            if getattr(lin, "_erased", False) or not _call(lin, _LINEAR) \
                    or get_arg(lin, 2, "bias") is not None:
                continue
            inp, weight = lin.args[0], get_arg(lin, 1, "weight")
            out_val = node_val(lin)
            if out_val is None or out_val.dim() != 2:
                continue
            norm = match_rmsnorm(inp) if self.norms else None
            x, w_norm, eps = norm if norm is not None else (inp, None, 0.0)
            mul = match_gated(lin) if self.layer else None
            rope = match_qkv_rope(lin) if self.layer and mul is None else None
            residual, add = ((None, None) if mul is not None or rope is not None
                             else self._residual(lin, out_val))
            if norm is None and mul is None and rope is None and residual is None:
                continue
            if rope is not None:
                self._fold_qkv(graph, rope, x, weight, w_norm, eps)
                self._kinds["rmsnorm"] += norm is not None
                self._kinds["rope_kv"] += 1
                count += 1
                continue
            replaced = mul if mul is not None else add if add is not None else lin
            with graph.inserting_before(replaced):
                if mul is not None:
                    new = graph.call_function(OPS.gated_linear.default, (x, w_norm, eps, weight))
                elif norm is not None:
                    new = graph.call_function(OPS.rmsnorm_linear.default,
                                              (x, w_norm, eps, weight, residual))
                else:
                    new = graph.call_function(OPS.skinny_linear.default, (inp, weight, residual))
            new.meta.update(replaced.meta)
            replaced.replace_all_uses_with(new)
            _erase_unused(graph, replaced)
            self._kinds["rmsnorm"] += norm is not None
            self._kinds["gated"] += mul is not None
            self._kinds["residual"] += residual is not None
            count += 1
        return count

    @staticmethod
    def _fold_qkv(graph: fx.Graph, rope: fx.Node, x: Any, weight: Any, w_norm: Any,
                  eps: float) -> None:
        """``rope`` (rope_write_kv) becomes qkv_rope_write_kv over ``x``; the projection, its
        view and slices (and the norm, unless read elsewhere) go."""
        _, _, kc, vc, slots, cos, sin, h = (get_arg(rope, i, f) for i, f in enumerate(
            ("qk", "value", "k_cache", "v_cache", "slot_mapping", "cos", "sin", "num_heads")))
        with graph.inserting_before(rope):
            new = graph.call_function(OPS.qkv_rope_write_kv.default,
                                      (x, weight, kc, vc, slots, cos, sin, h, w_norm, eps))
        new.meta.update(rope.meta)
        rope.replace_all_uses_with(new)
        inputs = rope.args[:2]
        graph.erase_node(rope)  # a mutating op: _erase_unused never erases one
        for n in inputs:
            _erase_unused(graph, n)

    @staticmethod
    def _residual(lin: fx.Node, out_val: Any) -> tuple[fx.Node | None, fx.Node | None]:
        """(r, add) when the linear's only user is ``r + linear`` of the same shape and dtype
        (no broadcast, no type promotion: the kernel adds [M, N] to [M, N])."""
        users = list(lin.users)
        if len(users) != 1 or not _call(users[0], _ADD):
            return None, None
        add = users[0]
        pair = _other(add, lambda n: n is lin)
        if pair is None or not isinstance(pair[1], fx.Node):
            return None, None
        r = pair[1]
        rv, av = node_val(r), node_val(add)
        if rv is None or av is None or rv.dtype != out_val.dtype or av.dtype != out_val.dtype:
            return None, None
        if not (same_size(rv.shape, out_val.shape) and same_size(av.shape, out_val.shape)):
            return None, None
        return r, add
