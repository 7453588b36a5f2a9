"""``SkinnyGemmFusion`` (passes/skinny_gemm.py): on a tiny CausalLM built from our decoder (q/k/v
and gate/up fused as the engine does), with layer + norm fusions each layer's RMSNorm -> qkv ->
rope + KV write, o_proj + residual, RMSNorm -> gate_up -> SiLU*mul and down + residual become one
fused op each, with layer fusions alone the same less the norms; by default
only o_proj + residual and down + residual do, the norms and SiLU*mul staying as they were. The
unfused nodes are gone, and the CPU reference path returns exactly the eager model's values. Off
by default; a traced eps, a biased linear and a non-matching graph are left alone."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from compiled_spec.compile import CompileConfig
from compiled_spec.models.config import ModelConfig
from compiled_spec.models.decoder import CausalLM
from compiled_spec.models.fuse import fuse_projections
from compiled_spec.models.layers import RMSNorm
from passes import PASS_ORDER, SkinnyGemmFusion, default_passes, make_backend
from passes.graph_utils import count_ops
from tests.test_passes import TABLE_A, make_meta

OPS = torch.ops.compiled_spec
LAYERS = 2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def tiny_lm(dtype: torch.dtype) -> CausalLM:
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=False,
                      attention_bias=False, qk_norm=False)
    torch.manual_seed(0)
    model = CausalLM(cfg)
    for name, p in model.named_parameters():  # norm weights away from 1: a dropped one shows
        if "norm" in name:
            p.data.uniform_(0.5, 1.5)
    model = model.to(dtype).eval().requires_grad_(False)  # inference, as the engine runs it
    assert fuse_projections(model) == 2 * LAYERS
    caches = [(torch.randn(8, 16, 2, 8).to(dtype), torch.randn(8, 16, 2, 8).to(dtype))
              for _ in range(LAYERS)]
    model.bind_kv_cache(caches)
    return model


def _counts(gm) -> dict[str, int]:
    def n(*targets):
        return sum(node.target in targets for node in gm.graph.nodes)
    return {"linear": n(torch._C._nn.linear), "rsqrt": n(torch.rsqrt, "rsqrt"),
            "silu": n(F.silu), "add": n(operator.add),
            "rmsnorm_linear": count_ops(gm, OPS.rmsnorm_linear),
            "gated_linear": count_ops(gm, OPS.gated_linear),
            "rope_write_kv": count_ops(gm, OPS.rope_write_kv),
            "qkv_rope_write_kv": count_ops(gm, OPS.qkv_rope_write_kv),
            "skinny_linear": count_ops(gm, OPS.skinny_linear)}


def _fuse(dtype: torch.dtype, layer: bool, norms: bool = False):
    """(graph before the passes, backend) after compiling ``tiny_lm`` once; the compiled call
    returns exactly the eager model's logits (the ops' CPU path is the unfused computation)."""
    model = tiny_lm(dtype)
    backend = make_backend(hoist_fc=False, per_layer_metadata=False, skinny_gemm=True,
                           skinny_layer=layer, skinny_norms=norms, inductor=False,
                           keep_graphs=True)
    before = {}

    def spy(gm, example_inputs):
        from passes.pipeline import _copy_graph_module
        before["gm"] = _copy_graph_module(gm)
        return backend(gm, example_inputs)

    compiled = torch.compile(model, backend=spy, fullgraph=True, dynamic=True)
    meta = make_meta([3, 2], [4, 0], TABLE_A)
    ids, pos = torch.randint(0, 64, (5,)), torch.tensor([4, 5, 6, 0, 1])
    with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True):
        want = model(ids, pos, meta)
        got = compiled(ids, pos, meta)
    assert torch.equal(got[0], want[0])
    return before["gm"], backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_layers_fuse_and_numerics_are_unchanged(dtype) -> None:
    before, backend = _fuse(dtype, layer=True, norms=True)
    old, new = _counts(before), _counts(backend.compiled[0].gm)
    assert old["linear"] == 4 * LAYERS and old["rsqrt"] == 2 * LAYERS + 1  # + the final norm
    # adds gone: both residuals and both norms' "+ eps" per layer
    # per layer: RMSNorm + qkv + rope + KV write, o_proj + residual, RMSNorm + gate_up +
    # SiLU*mul, down + residual
    assert old["rope_write_kv"] == LAYERS and old["qkv_rope_write_kv"] == 0
    assert new == {"linear": 0, "rsqrt": 1, "silu": 0, "add": old["add"] - 4 * LAYERS,
                   "rmsnorm_linear": 0, "gated_linear": LAYERS, "rope_write_kv": 0,
                   "qkv_rope_write_kv": LAYERS, "skinny_linear": 2 * LAYERS}
    assert backend.match_counts["SkinnyGemmFusion"] == 4 * LAYERS
    assert backend.graphs[0].details["SkinnyGemmFusion"] == {
        "rmsnorm": 2 * LAYERS, "gated": LAYERS, "residual": 2 * LAYERS, "rope_kv": LAYERS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_fuses_only_the_residual_epilogues(dtype) -> None:
    """The H200 measured every prologue fusion slower than the unfused ops (passes/skinny_gemm)."""
    before, backend = _fuse(dtype, layer=False)
    old, new = _counts(before), _counts(backend.compiled[0].gm)
    # o_proj and down take their residual; qkv, gate_up and lm_head stay plain linears behind
    # their norms, and SiLU*mul stays: only the two residual adds per layer are gone.
    assert new == {"linear": 2 * LAYERS + old["linear"] - 4 * LAYERS,
                   "rsqrt": old["rsqrt"], "silu": old["silu"],
                   "add": old["add"] - 2 * LAYERS, "rmsnorm_linear": 0, "gated_linear": 0,
                   "rope_write_kv": LAYERS, "qkv_rope_write_kv": 0,
                   "skinny_linear": 2 * LAYERS}
    assert backend.match_counts["SkinnyGemmFusion"] == 2 * LAYERS
    assert backend.graphs[0].details["SkinnyGemmFusion"] == {
        "rmsnorm": 0, "gated": 0, "residual": 2 * LAYERS, "rope_kv": 0}
    ids = {p.uuid() for p in (SkinnyGemmFusion(), SkinnyGemmFusion(layer=True),
                              SkinnyGemmFusion(layer=True, norms=True))}
    assert len(ids) == 3  # the options are part of the compile-cache key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_fusions_without_the_norms(dtype) -> None:
    """The default layer form: SiLU*mul and rope + KV write fold in, the norms stay Inductor's."""
    before, backend = _fuse(dtype, layer=True)
    old, new = _counts(before), _counts(backend.compiled[0].gm)
    assert new == {"linear": old["linear"] - 4 * LAYERS, "rsqrt": old["rsqrt"], "silu": 0,
                   "add": old["add"] - 2 * LAYERS, "rmsnorm_linear": 0, "gated_linear": LAYERS,
                   "rope_write_kv": 0, "qkv_rope_write_kv": LAYERS, "skinny_linear": 2 * LAYERS}
    assert backend.graphs[0].details["SkinnyGemmFusion"] == {
        "rmsnorm": 0, "gated": LAYERS, "residual": 2 * LAYERS, "rope_kv": LAYERS}


def test_decided_per_target_by_default_and_validated() -> None:
    # None: compiled_spec/gemm_policy.py decides per target (tests/test_gemm_policy.py)
    assert CompileConfig().skinny_gemm is None and CompileConfig().skinny_gemm_layer is None
    assert CompileConfig(skinny_gemm=True).skinny_gemm_layer is None
    assert CompileConfig(skinny_gemm=True).skinny_gemm_norms is False
    with pytest.raises(ValueError, match="skinny_gemm"):
        CompileConfig(skinny_gemm=1)
    with pytest.raises(ValueError, match="skinny_gemm_layer"):
        CompileConfig(skinny_gemm=True, skinny_gemm_layer="yes")
    with pytest.raises(ValueError, match="skinny_gemm_norms=True needs skinny_gemm"):
        CompileConfig(skinny_gemm_norms=True, skinny_gemm=None)
    with pytest.raises(ValueError, match="skinny_gemm_layer=True needs skinny_gemm"):
        CompileConfig(skinny_gemm_layer=True)
    with pytest.raises(ValueError, match="skinny_gemm_norms=True needs skinny_gemm"):
        CompileConfig(skinny_gemm_norms=True)
    assert not any(isinstance(p, SkinnyGemmFusion) for p in default_passes())
    fusion = [p for p in default_passes(skinny_gemm=True) if isinstance(p, SkinnyGemmFusion)]
    assert len(fusion) == 1 and fusion[0].layer is False and fusion[0].norms is False
    assert [(p.layer, p.norms) for p in default_passes(skinny_gemm=True, skinny_layer=True,
                                                       skinny_norms=True)
            if isinstance(p, SkinnyGemmFusion)] == [(True, True)]
    assert PASS_ORDER[-1] is SkinnyGemmFusion


class Leftovers(nn.Module):
    """Nothing to fuse: a biased linear after a norm, a linear feeding a broadcasting add."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(16, 1e-6)
        self.biased = nn.Linear(16, 16)
        self.plain = nn.Linear(16, 16, bias=False)

    def forward(self, x: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        return self.biased(self.norm(x)) + (self.plain(x) + row)  # row: [16], broadcast


def test_unmatched_and_traced_eps_are_left_alone() -> None:
    backend = make_backend(hoist_fc=False, per_layer_metadata=False, skinny_gemm=True,
                           inductor=False)
    x, row = torch.randn(3, 16), torch.randn(16)
    with torch._dynamo.config.patch(specialize_float=True):
        torch.compile(Leftovers(), backend=backend, fullgraph=True, dynamic=True)(x, row)
    assert backend.match_counts["SkinnyGemmFusion"] == 0
    # Without specialize_float eps is traced (``eps.item()``): the norm is not rewritten.
    torch._dynamo.reset()
    backend = make_backend(hoist_fc=False, per_layer_metadata=False, skinny_gemm=True,
                           inductor=False)
    norm, lin = RMSNorm(16, 1e-6), nn.Linear(16, 8, bias=False)
    torch.compile(lambda x: lin(norm(x)), backend=backend, fullgraph=True, dynamic=True)(x)
    assert backend.match_counts["SkinnyGemmFusion"] == 0


def test_gate_up_read_elsewhere_is_not_gated() -> None:
    """The gated op replaces silu(g) * u only when nothing else reads g or u."""
    backend = make_backend(hoist_fc=False, per_layer_metadata=False, skinny_gemm=True,
                           skinny_layer=True, inductor=False)
    lin = nn.Linear(16, 24, bias=False)

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [M, 16] -> [M, 12] x 2
        g, u = lin(x).chunk(2, dim=-1)
        return F.silu(g) * u, g

    x = torch.randn(3, 16)
    with torch._dynamo.config.patch(specialize_float=True):
        got = torch.compile(fn, backend=backend, fullgraph=True, dynamic=True)(x)
    assert backend.match_counts["SkinnyGemmFusion"] == 0
    assert all(torch.equal(a, b) for a, b in zip(got, fn(x)))
