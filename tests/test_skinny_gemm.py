"""Skinny GEMM ops (``compiled_spec::skinny_linear`` / ``rmsnorm_linear`` / ``gated_linear``):
the Triton kernel under TRITON_INTERPRET=1 (in a subprocess: the interpreter must be chosen
before triton is imported) against the exact PyTorch reference for every prologue / epilogue,
fp32 and bf16, shapes whose K and N are not multiples of the tiles; the reference against the
model's own modules; the ops under opcheck and torch.compile; the launch policy."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the Triton worker runs this file as a script
    sys.path.insert(0, str(REPO_ROOT))

from kernels.gemm_config import (MAX_M, WIDE_MAX_M, GemmConfig, block_m_for,  # noqa: E402
                                 candidates, gemm_config)
from tests.triton_interpret import run_interpreted  # noqa: E402

K, N = 96, 40  # K: 1.5 tiles of 64; N: 2.5 tiles of 16 (both tails masked)
# (prologue, epilogue) forms: a residual only where the op takes one (not gated)
FORMS = [("none", "none"), ("none", "residual"), ("rmsnorm", "none"), ("rmsnorm", "residual"),
         ("none", "gated"), ("rmsnorm", "gated")]
TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # max |err| relative to max |ref|
# A gated output multiplies two rounded values: a one-ulp difference in the rounding of gate
# (a different fp32 summation order) comes out scaled by up, so bf16 gets twice the room.
GATED_TOL = {"float32": 1e-4, "bfloat16": 4e-2}
# (name, M, dtype, config or None for gemm_config's pick): the default dot path at M = 1 and 5,
# split-K (partials + reducing launch), the FMA path with an unpadded block_m.
RUNS = [("auto", 1, "float32", None), ("auto", 5, "float32", None),
        ("auto", 1, "bfloat16", None), ("auto", 5, "bfloat16", None),
        ("split3", 5, "bfloat16", GemmConfig(16, 16, 32, split_k=3)),
        ("fma", 5, "float32", GemmConfig(8, 16, 32, use_dot=False)),
        # past one tile (the wide option): 70 rows in tiles of 64, also with split-K
        ("tiles", 70, "float32", None), ("tiles", 70, "bfloat16", None),
        ("tilesplit3", 70, "bfloat16", GemmConfig(64, 16, 32, split_k=3))]


def _inputs(m: int, gated: bool, dtype: torch.dtype, g: torch.Generator) -> dict:
    n_w = 2 * N if gated else N
    return dict(x=(torch.randn(m, K, generator=g) * 3).to(dtype),  # [M, K]
                w=(torch.randn(n_w, K, generator=g) / K ** 0.5).to(dtype),  # [N or 2N, K]
                nw=(1 + 0.5 * torch.randn(K, generator=g)).to(dtype),  # [K]
                res=torch.randn(m, N, generator=g).to(dtype))  # [M, N]


def _reference(d: dict, prologue: str, epilogue: str) -> torch.Tensor:  # [M, N]
    from kernels.skinny_gemm_ref import gated_linear_ref, linear_ref, rmsnorm_linear_ref

    res = d["res"] if epilogue == "residual" else None
    nw = d["nw"] if prologue == "rmsnorm" else None
    if epilogue == "gated":
        return gated_linear_ref(d["x"], nw, 1e-5, d["w"])
    if prologue == "rmsnorm":
        return rmsnorm_linear_ref(d["x"], d["nw"], 1e-5, d["w"], res)
    return linear_ref(d["x"], d["w"], res)


def _worker(device: str = "cpu") -> None:
    """Under TRITON_INTERPRET=1 (the tests), or ``python tests/test_skinny_gemm.py --cuda`` on
    a GPU: every form against the reference before a device session times it."""
    from kernels.skinny_gemm_triton import skinny_gemm_triton

    g = torch.Generator().manual_seed(0)
    out = {}
    for name, m, dtype_name, cfg in RUNS:
        dtype = getattr(torch, dtype_name)
        for prologue, epilogue in FORMS:
            d = {k: v.to(device) for k, v in _inputs(m, epilogue == "gated", dtype, g).items()}
            call = dict(norm_weight=d["nw"] if prologue == "rmsnorm" else None, eps=1e-5,
                        gated=epilogue == "gated",
                        residual=d["res"] if epilogue == "residual" else None, config=cfg)
            key = f"{name}_m{m}_{dtype_name}_{prologue}_{epilogue}"
            if epilogue == "gated" and cfg is not None and cfg.split_k > 1:
                try:  # the gated epilogue needs whole sums: a split config is refused
                    skinny_gemm_triton(d["x"], d["w"], **call)
                    out[key] = [False, "split-K accepted"]
                except ValueError as e:
                    out[key] = [True, 0.0] if "splits K" in str(e) else [False, str(e)]
                continue
            y = skinny_gemm_triton(d["x"], d["w"], **call)
            ref = _reference(d, prologue, epilogue).float()
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            out[key] = [y.dtype == dtype and y.shape == ref.shape, err]
    from kernels.skinny_gemm_ref import silu_mul_ref
    from kernels.skinny_gemm_triton import silu_mul_triton

    for dtype_name in ("float32", "bfloat16"):  # prefill-sized gated op: the SiLU-and-mul launch
        gu = (torch.randn(70, 2 * 1100, generator=g) * 3).to(getattr(torch, dtype_name))
        y, ref = silu_mul_triton(gu.to(device)), silu_mul_ref(gu).to(device)
        err = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        out[f"silu_mul_{dtype_name}"] = [y.shape == ref.shape and y.dtype == ref.dtype, err]
    print("RESULTS " + json.dumps(out))


def test_triton_skinny_gemm_matches_the_reference() -> None:
    res = run_interpreted(__file__)
    assert len(res) == len(RUNS) * len(FORMS) + 2, res
    bad = {k: v for k, v in res.items()
           if not (v[0] and v[1] < (GATED_TOL if k.endswith("gated") else TOL)[k.split("_")[-1]
                                    if k.startswith("silu_mul") else k.split("_")[2]])}
    assert not bad, bad


def test_references_are_the_model_modules() -> None:
    """The CPU path of a rewritten graph must compute what the unfused model did, bit for bit."""
    from compiled_spec.models.layers import GatedMLP, RMSNorm
    from kernels.skinny_gemm_ref import gated_linear_ref, rmsnorm_linear_ref

    torch.manual_seed(0)
    norm = RMSNorm(K, 1e-6).to(torch.bfloat16)
    norm.weight.data.normal_()
    lin = torch.nn.Linear(K, N, bias=False).to(torch.bfloat16)
    x, res = torch.randn(5, K, dtype=torch.bfloat16), torch.randn(5, N, dtype=torch.bfloat16)
    assert torch.equal(rmsnorm_linear_ref(x, norm.weight, 1e-6, lin.weight, res),
                       res + lin(norm(x)))
    mlp = GatedMLP(N, K).to(torch.bfloat16)
    mlp.gate_up_proj = torch.nn.Linear(N, 2 * K, bias=False).to(torch.bfloat16)
    norm2 = RMSNorm(N, 1e-6).to(torch.bfloat16)
    norm2.weight.data.normal_()
    h = torch.randn(5, N, dtype=torch.bfloat16)
    act = gated_linear_ref(h, norm2.weight, 1e-6, mlp.gate_up_proj.weight)  # [5, K]
    assert torch.equal(h + F.linear(act, mlp.down_proj.weight), h + mlp(norm2(h)))


def test_ops_pass_opcheck_and_trace_under_compile() -> None:
    import kernels.ops  # noqa: F401

    ops = torch.ops.compiled_spec
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, K, generator=g), torch.randn(N, K, generator=g)
    nw, r = torch.randn(K, generator=g), torch.randn(5, N, generator=g)
    w2 = torch.randn(2 * N, K, generator=g)  # [gate; up]
    calls = [(ops.skinny_linear, (x, w)), (ops.skinny_linear, (x, w, r)),
             (ops.rmsnorm_linear, (x, nw, 1e-6, w, r)), (ops.gated_linear, (x, nw, 1e-6, w2)),
             (ops.gated_linear, (x, None, 0.0, w2))]
    for op, args in calls:
        torch.library.opcheck(op, args)

    def fn(x, r):  # [M, K], [M, N]
        return ops.rmsnorm_linear(x, nw, 1e-6, w, r) + ops.gated_linear(x, nw, 1e-6, w2)

    compiled = torch.compile(fn, backend="eager", fullgraph=True, dynamic=True)
    for m in (3, 7):  # one graph, symbolic M: the fake kernels propagate [M, N]
        xm, rm = x.repeat(2, 1)[:m], r.repeat(2, 1)[:m]
        assert torch.allclose(compiled(xm, rm), fn(xm, rm))
    with pytest.raises(ValueError, match="dtype"):
        from kernels.skinny_gemm_triton import skinny_gemm_triton
        skinny_gemm_triton(x, w.to(torch.bfloat16))


def test_launch_policy() -> None:
    shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]  # (K, N)
    for m in (1, 2, 6, 16, 33, 48, MAX_M):
        for k, n in shapes:
            cfg = gemm_config(m, n, k)
            assert cfg.block_m >= m and cfg.block_m >= 16 and cfg.use_dot
            ctas = -(-n // cfg.block_n) * cfg.split_k
            assert ctas >= 36, (m, k, n, cfg)  # cuBLAS's 64-wide tiles gave 9 for N=576
            cands = candidates(m, n, k)
            assert cands[0] == cfg and len(set(cands)) == len(cands) <= 16
            assert all(c.block_m >= m for c in cands)
            assert any(not c.use_dot for c in cands) == (m <= 8)
    # the H200's winner for every layer GEMM (session 11): no split-K, 128-deep K steps
    assert gemm_config(6, 576, 1536) == GemmConfig(16, 16, 128, num_stages=4)
    assert all(gemm_config(m, n, k).split_k == 1 for m in (1, 48) for k, n in shapes)
    assert {block_m_for(m) for m in range(1, MAX_M + 1)} == {16, 32, 64}  # few binaries
    # past MAX_M (the wide option): tiles of MAX_M rows, up to WIDE_MAX_M
    assert {block_m_for(m) for m in range(MAX_M + 1, WIDE_MAX_M + 1)} == {MAX_M}
    assert gemm_config(192, 576, 576).block_m == MAX_M
    # deep K (the 8B shape on the H100, session 45): 256-deep steps for tiles of <= 16 rows, 4
    # stages for few N tiles, 3 for gate_up's many; 128-deep steps for taller tiles (their A
    # tile and squares would not fit); SmolLM2's lm_head (K = 576) keeps 64-deep steps
    assert gemm_config(1, 6144, 4096) == GemmConfig(16, 64, 256, num_stages=4)
    assert gemm_config(8, 14336, 4096) == GemmConfig(16, 64, 256, num_stages=3)  # gate_up
    assert gemm_config(1, 4096, 14336) == GemmConfig(16, 16, 256, num_stages=4)
    assert gemm_config(24, 6144, 4096) == GemmConfig(32, 64, 128, num_stages=4)
    assert gemm_config(1, 49152, 576) == GemmConfig(16, 64, 64)
    # shared memory of the num_stages - 1 buffered A and W tiles (gate_up's paired W tiles: its
    # 14336 outputs read two weight rows each): at most what ran on the H100 (session 45,
    # gate_up at 16 rows, ~147 KB)
    for m in (1, 16, 17, 64):
        for k, n, w_tiles in ((4096, 6144, 1), (4096, 4096, 1), (4096, 14336, 2),
                              (14336, 4096, 1)):
            c = gemm_config(m, n, k)
            smem = (c.num_stages - 1) * (c.block_m + w_tiles * c.block_n) * c.block_k * 2
            assert smem <= 150 * 1024, (c, smem)
    # the benchmark tries deeper pipelines for deep K only (few binaries for SmolLM2's shapes)
    assert {c.block_k for c in candidates(1, 4096, 4096)} >= {256}
    assert all(c.block_k <= 128 and c.num_stages <= 4 for c in candidates(1, 576, 576))
    with pytest.raises(ValueError, match="rows"):
        gemm_config(WIDE_MAX_M + 1, 576, 576)


def test_wide_scope_widens_the_ops_rows() -> None:
    """The ops take their Triton kernels up to MAX_M rows, WIDE_MAX_M inside the wide scope
    (an engine with CompileConfig.skinny_gemm_wide holds it around its compiled calls)."""
    from kernels.dispatch import skinny_max_rows, skinny_wide_scope

    assert skinny_max_rows() == MAX_M
    with skinny_wide_scope(True):
        assert skinny_max_rows() == WIDE_MAX_M
        with skinny_wide_scope(False):
            assert skinny_max_rows() == MAX_M
    assert skinny_max_rows() == MAX_M


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
elif __name__ == "__main__" and "--cuda" in sys.argv:
    _worker("cuda")
