"""``SkinnyGemmFusion``: rewrite the decoder's norm / activation / residual around each linear
into one fused skinny-GEMM op (``kernels.ops``), a single Triton launch at decode sizes.

On Dynamo's graph (torch level) of ``compiled_spec.models``:
  RMSNorm -> linear                      => compiled_spec::rmsnorm_linear(x, w_norm, eps, W)
  chunk(gate_up, 2) -> silu(g) * u -> linear  => compiled_spec::silu_mul_linear(gate_up, W)
  r + linear(...) (the linear's only user) => the op above, or skinny_linear, with residual=r
With ``prologues=True`` a decoder layer's 4 GEMMs carry its 2 RMSNorms, its SiLU-and-mul and
both residual adds. By default (``prologues=False``) only the residual epilogues are fused: o_proj
and down become ``skinny_linear(x, W, residual=r)``, and the norms and SiLU-and-mul stay Inductor's
kernels in front of cuBLAS. Measured on the H200 (sixteenth session, CUDA-graph replay, L2-cold
weights, M = 1): o_proj + residual 3.31 us fused vs 4.72 unfused, while every prologue fusion lost
even under its best tile config (RMSNorm + qkv 5.73 vs 4.68, RMSNorm + gate_up 6.18 vs 5.43,
SiLU-mul + down + residual 10.59 vs 7.70): the prologue costs the kernel more than the separate
kernel it saves. The ops compute exactly the unfused ops where the Triton kernel does not run
(CPU; more than ``MAX_M`` rows on the GPU, i.e. prefill), so only the GPU's bf16 rounding inside
the kernel differs. Off by default (``CompileConfig.skinny_gemm``) until measured end to end.

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
from passes.graph_utils import get_arg, is_op, node_val, same_size, trace_to_root

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
    """Each rewritten linear counts once (its prologue and residual fold into the same node).
    ``prologues``: also fold RMSNorm and SiLU-and-mul into the GEMM (see the module docstring
    for why that is off by default)."""

    def __init__(self, keep_graphs: bool = False, prologues: bool = False) -> None:
        super().__init__(keep_graphs)
        self.prologues = prologues
        self._kinds: dict[str, int] = {}

    def config(self) -> dict[str, Any]:
        return {"prologues": self.prologues}

    def details(self) -> dict[str, Any]:
        return dict(self._kinds)

    def apply(self, gm: fx.GraphModule) -> int:
        self._kinds = {"rmsnorm": 0, "silu_mul": 0, "residual": 0}
        graph = gm.graph
        count = 0
        for lin in list(graph.nodes):
            if not _call(lin, _LINEAR) or get_arg(lin, 2, "bias") is not None:
                continue
            inp, weight = lin.args[0], get_arg(lin, 1, "weight")
            out_val = node_val(lin)
            if out_val is None or out_val.dim() != 2:
                continue
            residual, add = self._residual(lin, out_val)
            norm = match_rmsnorm(inp) if self.prologues else None
            gate_up = None if norm or not self.prologues else match_silu_mul(inp)
            if norm is None and gate_up is None and residual is None:
                continue
            with graph.inserting_before(add if add is not None else lin):
                if norm is not None:
                    x, w_norm, eps = norm
                    new = graph.call_function(OPS.rmsnorm_linear.default,
                                              (x, w_norm, eps, weight, residual))
                elif gate_up is not None:
                    new = graph.call_function(OPS.silu_mul_linear.default,
                                              (gate_up, weight, residual))
                else:
                    new = graph.call_function(OPS.skinny_linear.default, (inp, weight, residual))
            replaced = add if add is not None else lin
            new.meta.update(replaced.meta)
            replaced.replace_all_uses_with(new)
            _erase_unused(graph, replaced)
            self._kinds["rmsnorm"] += norm is not None
            self._kinds["silu_mul"] += gate_up is not None
            self._kinds["residual"] += residual is not None
            count += 1
        return count

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
