"""The qkv + rope + KV-write op (``compiled_spec::qkv_rope_write_kv``, what the skinny-GEMM pass
makes of a layer's [RMSNorm ->] qkv projection -> rope_write_kv): its Triton kernel, run by
Triton's interpreter on the CPU (or ``python tests/test_qkv_rope.py --cuda`` on a GPU), against
the reference: the roped queries, the roped keys and the values in their paged slots, padding
rows (slot -1) leaving the cache untouched, with and without the norm, fp32 and bf16; the op
on the CPU is the reference, and it compiles."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.skinny_gemm_ref import qkv_rope_write_kv_ref  # noqa: E402

K = 96  # 1.5 of the kernel's 64-deep K steps at its smallest: a masked tail
# (heads, kv_heads, head_dim, page_size, rows, dtype, norm)
CASES = [(9, 3, 64, 16, 5, "float32", True), (4, 2, 32, 4, 1, "bfloat16", False),
         (9, 3, 64, 64, 7, "bfloat16", True), (4, 4, 32, 1, 3, "float32", False),
         # past one tile of 64 rows (the wide option: tiles of 64, a padding row in the second)
         (4, 2, 32, 16, 70, "float32", True), (4, 2, 32, 16, 70, "bfloat16", False)]
TOL = {"float32": 1e-4, "bfloat16": 2e-2}  # max |err| relative to max |ref|


def _inputs(heads: int, kvh: int, d: int, page: int, m: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    blocks = 8  # blocks * page >= m for every page size
    x = (torch.randn(m, K, generator=g) * 2).to(dtype)  # [M, K]
    w = (torch.randn((heads + 2 * kvh) * d, K, generator=g) / K ** 0.5).to(dtype)
    nw = (1 + 0.5 * torch.randn(K, generator=g)).to(dtype)  # [K]
    ang = torch.rand(m, d // 2, generator=g) * 6.0
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # [M, d]
    kc = torch.randn(blocks, page, kvh, d, generator=g).to(dtype)
    vc = torch.randn(blocks, page, kvh, d, generator=g).to(dtype)
    slots = torch.randperm(blocks * page, generator=g)[:m].to(torch.int64)
    if m > 2:
        slots[1] = -1  # a padding row
    if m > 66:
        slots[66] = -1  # and one in the second tile
    return x, w, nw, kc, vc, slots, cos, sin


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()


def _worker(device: str = "cpu") -> None:
    import json

    from kernels.qkv_rope_triton import qkv_rope_write_kv_triton

    results = {}
    for case in CASES:
        heads, kvh, d, page, m, dt, norm = case
        x, w, nw, kc, vc, slots, cos, sin = (t.to(device) for t in _inputs(
            heads, kvh, d, page, m, getattr(torch, dt)))
        nw = nw if norm else None
        rk, rv, tk, tv = kc.clone(), vc.clone(), kc.clone(), vc.clone()
        want = qkv_rope_write_kv_ref(x, w, rk, rv, slots, cos, sin, heads, nw, 1e-5)
        got = qkv_rope_write_kv_triton(x, w, tk, tv, slots, cos, sin, heads, nw, 1e-5)
        live = slots[slots >= 0]
        flat = (-1, kvh, d)
        dead = torch.ones(kc.shape[0] * page, dtype=torch.bool, device=device)
        dead[live] = False
        results[str(case)] = {
            "q": _rel(got, want), "k": _rel(tk.reshape(flat)[live], rk.reshape(flat)[live]),
            "v": _rel(tv.reshape(flat)[live], rv.reshape(flat)[live]),
            "untouched": bool(torch.equal(tk.reshape(flat)[dead], kc.reshape(flat)[dead])
                              and torch.equal(tv.reshape(flat)[dead], vc.reshape(flat)[dead])),
            "shape": list(got.shape) == [m, heads, d] and got.dtype == x.dtype}
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def triton_results() -> dict:
    from tests.triton_interpret import run_interpreted

    return run_interpreted(__file__)


@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_reference(triton_results: dict, case) -> None:
    r = triton_results[str(case)]
    tol = TOL[case[5]]
    assert r["untouched"] and r["shape"], r
    assert r["q"] < tol and r["k"] < tol and r["v"] < tol, r


def test_op_is_the_reference_on_cpu_and_compiles() -> None:
    import kernels  # noqa: F401  (registers the ops)

    x, w, nw, kc, vc, slots, cos, sin = _inputs(9, 3, 64, 16, 5, torch.float32)
    rk, rv = kc.clone(), vc.clone()
    want = qkv_rope_write_kv_ref(x, w, rk, rv, slots, cos, sin, 9, nw, 1e-5)

    def f(x, kc, vc, slots, cos, sin):
        return torch.ops.compiled_spec.qkv_rope_write_kv(x, w, kc, vc, slots, cos, sin, 9, nw,
                                                         1e-5) * 2

    got = torch.compile(f, backend="eager", fullgraph=True)(x, kc, vc, slots, cos, sin)
    assert torch.equal(got, want * 2) and torch.equal(kc, rk) and torch.equal(vc, rv)
    torch.library.opcheck(torch.ops.compiled_spec.qkv_rope_write_kv,
                          (x, w, kc.clone(), vc.clone(), slots, cos, sin, 9, None, 0.0))


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
elif __name__ == "__main__" and "--cuda" in sys.argv:
    _worker("cuda")
