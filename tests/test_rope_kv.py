"""The rope + KV-write op (``compiled_spec::rope_write_kv``): its reference equals the model's
two-step path (``apply_rope`` on q and k, then ``write_kv``), and its Triton kernel, run by
Triton's interpreter on the CPU, equals the reference: strided inputs (views of the fused qkv
GEMM's output), padding rows (slot -1) that leave the cache untouched, several page sizes and
head counts, fp32 and bf16."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels.attention_ref import rope_write_kv_ref, write_kv_ref  # noqa: E402

# (heads, kv_heads, head_dim, page_size, dtype)
CASES = [(9, 3, 64, 16, "float32"), (4, 4, 32, 1, "float32"), (8, 2, 16, 4, "bfloat16"),
         (9, 3, 64, 64, "bfloat16")]


def _inputs(heads: int, kv_heads: int, d: int, page: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t, blocks = 7, 8  # blocks * page >= t for every page size
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)  # the GEMM output
    qk = qkv[:, :(heads + kv_heads) * d].view(t, heads + kv_heads, d)  # strided views
    v = qkv[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    ang = torch.rand(t, d // 2, generator=g) * 6.0
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    k_cache = torch.randn(blocks, page, kv_heads, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, page, kv_heads, d, generator=g).to(dtype)
    slots = torch.randperm(blocks * page, generator=g)[:t].to(torch.int64)
    slots[2] = slots[5] = -1  # padding rows
    return qk, v, k_cache, v_cache, slots, cos, sin


@pytest.mark.parametrize("case", CASES)
def test_reference_equals_rope_then_write(case) -> None:
    from compiled_spec.models.layers import apply_rope

    heads, kvh, d, page, dt = case
    qk, v, kc, vc, slots, cos, sin = _inputs(heads, kvh, d, page, getattr(torch, dt))
    kc0, kc2, vc2 = kc.clone(), kc.clone(), vc.clone()
    q = rope_write_kv_ref(qk, v, kc, vc, slots, cos, sin, heads)
    roped = apply_rope(qk, cos, sin)
    write_kv_ref(roped[:, heads:], v, kc2, vc2, slots)
    assert torch.equal(q, roped[:, :heads]) and q.is_contiguous()
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    # the padding rows wrote nothing: every slot not in the mapping holds its old value
    live = slots[slots >= 0]
    untouched = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    untouched[live] = False
    flat = (-1, kvh, d)
    assert torch.equal(kc.reshape(flat)[untouched], kc0.reshape(flat)[untouched])
    assert not torch.equal(kc.reshape(flat)[live], kc0.reshape(flat)[live])


def test_op_dispatches_to_the_reference_on_cpu_and_compiles() -> None:
    import kernels  # noqa: F401  (registers the ops)

    qk, v, kc, vc, slots, cos, sin = _inputs(9, 3, 64, 16, torch.float32)
    ref_k, ref_v = kc.clone(), vc.clone()
    want = rope_write_kv_ref(qk, v, ref_k, ref_v, slots, cos, sin, 9)

    def f(qk, v, kc, vc, slots, cos, sin):
        return torch.ops.compiled_spec.rope_write_kv(qk, v, kc, vc, slots, cos, sin, 9) * 2

    got = torch.compile(f, backend="eager", fullgraph=True)(qk, v, kc, vc, slots, cos, sin)
    assert torch.equal(got, want * 2) and torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def _worker(device: str = "cpu") -> None:
    """Under TRITON_INTERPRET=1 (the tests), or ``python tests/test_rope_kv.py --cuda`` on a GPU:
    the compiled kernel against the reference, before a device session relies on it."""
    import json

    from kernels.rope_kv_triton import rope_write_kv_triton

    results = {}
    for case in CASES:
        heads, kvh, d, page, dt = case
        qk, v, kc, vc, slots, cos, sin = (t.to(device) for t in _inputs(heads, kvh, d, page,
                                                                         getattr(torch, dt)))
        tk, tv = kc.clone(), vc.clone()
        want = rope_write_kv_ref(qk.float(), v.float(), kc.float(), vc.float(), slots,
                                 cos.float(), sin.float(), heads)
        # the reference in fp32 then rounded: the kernel's one rounding per output
        rk, rv = kc.float(), vc.float()
        rope_write_kv_ref(qk.float(), v.float(), rk, rv, slots, cos.float(), sin.float(), heads)
        got = rope_write_kv_triton(qk, v, tk, tv, slots, cos, sin, heads)
        tol = 0.0 if dt == "float32" else 1e-2
        results[str(case)] = {
            "q": bool(torch.allclose(got.float(), want, atol=tol + 1e-6, rtol=tol)),
            "k": bool(torch.allclose(tk.float(), rk.to(kc.dtype).float(), atol=tol + 1e-6,
                                     rtol=tol)),
            "v": bool(torch.equal(tv, rv.to(vc.dtype))),
            "shape": list(got.shape) == [qk.shape[0], heads, d],
        }
    results["rope_table"] = _rope_table_case(device)
    print("RESULTS " + json.dumps(results))


def _rope_table_case(device: str) -> dict:
    """The rope-table gather kernel: exactly the reference's rows and casts (a copy, no math),
    over more rows than one program holds, with a padding row's stray positions clamped."""
    from compiled_spec.models.layers import RotaryEmbedding
    from kernels.attention_ref import rope_table_ref
    from kernels.rope_kv_triton import rope_table_triton

    rope = RotaryEmbedding(64, 100, 10000.0, None)
    cc, sc = rope.cos_cache.to(device), rope.sin_cache.to(device)
    pos = torch.tensor([0, 99, 3, 57, 57, 12] * 4 + [1], device=device)
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        got, want = rope_table_triton(pos, cc, sc, dt), rope_table_ref(pos, cc, sc, dt)
        out[str(dt)] = all(torch.equal(a, b) and a.dtype == dt for a, b in zip(got, want))
    stray = rope_table_triton(torch.tensor([-1, 100, 5000], device=device), cc, sc,
                              torch.float32)
    out["clamped"] = torch.equal(stray[0], cc[[0, 99, 99]])
    return out


@pytest.fixture(scope="module")
def triton_results() -> dict:
    from tests.triton_interpret import run_interpreted

    return run_interpreted(__file__)


@pytest.mark.parametrize("case", CASES)
def test_triton_kernel_matches_reference(triton_results: dict, case) -> None:
    r = triton_results[str(case)]
    assert r == {"q": True, "k": True, "v": True, "shape": True}, r


def test_rope_table_kernel_matches_reference(triton_results: dict) -> None:
    r = triton_results["rope_table"]
    assert r == {"torch.float32": True, "torch.bfloat16": True, "clamped": True}, r


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()
elif __name__ == "__main__" and "--cuda" in sys.argv:
    _worker("cuda")
