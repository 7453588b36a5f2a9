"""``UnfuseResidualAddmm`` (post-grad): turn ``addmm(residual, x, W)`` back into ``residual + mm``.

Inductor folds a residual add into the GEMM that precedes it (``hidden + o_proj(x)`` becomes one
``addmm`` with beta = 1). With a full [T, h] matrix as the addend, cuBLAS first copies it into the
output (a separate ``memcpy32_post`` kernel) and then accumulates, so the fusion *adds* a kernel
per residual: the H200 profile of a SmolLM2 decode step showed 54 such copies, two per layer. Left
as a plain add, the sum is a pointwise op that Inductor's scheduler fuses into the RMSNorm that
reads it next (one kernel computing the sum, writing the new residual and normalising), so the
copy disappears. It also matches eager's rounding exactly (the product is rounded to the
activation dtype before the add, as ``F.linear`` + ``+`` do).

Only addmm nodes whose addend has the output's full 2-D shape are rewritten; a bias vector
(broadcast over rows) is a GEMM epilogue without a copy and stays fused. Runs as an Inductor
post-grad custom pass on the ATen graph, after Inductor's own pattern passes.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from passes.base import GraphPass

aten = torch.ops.aten


def _full_addend(node: fx.Node) -> bool:
    inp = node.args[0]
    if not isinstance(inp, fx.Node):
        return False
    a, out = inp.meta.get("val"), node.meta.get("val")
    if not isinstance(a, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    return a.dim() == 2 and a.dtype == out.dtype and tuple(a.shape) == tuple(out.shape)


class UnfuseResidualAddmm(GraphPass):
    def apply(self, gm: fx.GraphModule) -> int:
        return self.apply_graph(gm.graph)

    def apply_graph(self, graph: fx.Graph) -> int:
        """The rewrite on a bare graph (Inductor hands post-grad passes an ``fx.Graph``)."""
        n = 0
        for node in list(graph.find_nodes(op="call_function", target=aten.addmm.default)):
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
                continue
            if len(node.args) != 3 or not _full_addend(node):
                continue
            inp, mat1, mat2 = node.args
            with graph.inserting_before(node):
                mm = graph.call_function(aten.mm.default, (mat1, mat2))
                add = graph.call_function(aten.add.Tensor, (inp, mm))
            for new in (mm, add):
                new.meta.update(node.meta)  # same shape, dtype and device as the addmm
            node.replace_all_uses_with(add)
            graph.erase_node(node)
            n += 1
        return n
