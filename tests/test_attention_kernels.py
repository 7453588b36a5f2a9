"""Paged-KV attention ops: reference vs an independent naive attention, Triton kernels vs the
reference (under the Triton CPU interpreter, in a subprocess), and the custom ops under
torch.compile(fullgraph=True).

The naive attention never looks at the paged cache: it runs SDPA on each sequence's logical,
contiguous K/V, so a wrong block-table lookup, causal offset or GQA mapping in the paged
implementations shows up as a mismatch.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the Triton worker runs this file as a script
    sys.path.insert(0, str(REPO_ROOT))

from kernels.attention_ref import paged_attention_ref, write_kv_ref  # noqa: E402
from tests.triton_interpret import run_interpreted  # noqa: E402

# (tokens already in the cache, new query tokens) per sequence: prefill from scratch, prefill
# after existing context (chunked prefill), decode, decode of the very first token, a padding
# sequence (q_len 0), verification of k+1 = 4 and 8 tokens, and a long-ish prefill.
MIXED_BATCH: list[tuple[int, int]] = [(0, 13), (7, 20), (30, 1), (0, 1), (5, 0), (11, 4),
                                      (40, 8), (0, 37)]
# Contexts long enough that every forced KV split has keys (MIXED_BATCH's 48 fit the first).
LONG_BATCH: list[tuple[int, int]] = [(505, 1), (290, 6), (0, 1), (150, 32)]
NUM_UNOWNED_TOKENS = 2  # trailing query rows no sequence owns (CUDA-graph padding): output 0


@dataclass
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    new_k: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]; this step's keys
    new_v: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for unowned rows
    k_cache: torch.Tensor  # [num_blocks, page_size, num_kv_heads, head_dim]; context only
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, -1 past each sequence's end
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    logical_k: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim]
    logical_v: list[torch.Tensor]

    def attn_args(self, k_cache=None, v_cache=None) -> tuple:
        return (self.query, self.k_cache if k_cache is None else k_cache,
                self.v_cache if v_cache is None else v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.max_query_len, self.max_seq_len,
                self.query.shape[-1] ** -0.5)


def make_batch(spec: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               page_size: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> Batch:
    """Random sequences over shuffled physical blocks. The cache holds only the pre-existing
    context (everything else is random garbage that must never be read); the new tokens' K/V
    come separately so a test can write them with write_kv."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in spec]
    blocks_per_seq = [-(-n // page_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks full of garbage
    perm = torch.randperm(num_blocks, generator=g).tolist()  # non-contiguous physical blocks
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.full((len(spec), max_blocks), -1, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, generator=g) * 10
    v_cache = torch.randn(num_blocks, page_size, num_kv_heads, head_dim, generator=g) * 10
    queries, new_k, new_v, slots, logical_k, logical_v = [], [], [], [], [], []
    for b, ((ctx, q_len), n) in enumerate(zip(spec, seq_lens)):
        own = [perm.pop() for _ in range(blocks_per_seq[b])]
        block_tables[b, : len(own)] = torch.tensor(own, dtype=torch.int32)
        k = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g)
        logical_k.append(k.to(dtype))
        logical_v.append(v.to(dtype))
        for pos in range(n):
            blk, off = own[pos // page_size], pos % page_size
            if pos < ctx:  # context written by earlier steps, placed by hand
                k_cache[blk, off], v_cache[blk, off] = k[pos], v[pos]
            else:
                slots.append(blk * page_size + off)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=g))
        new_k.append(k[ctx:])
        new_v.append(v[ctx:])
    queries.append(torch.randn(NUM_UNOWNED_TOKENS, num_heads, head_dim, generator=g))
    new_k.append(torch.randn(NUM_UNOWNED_TOKENS, num_kv_heads, head_dim, generator=g) * 100)
    new_v.append(torch.randn(NUM_UNOWNED_TOKENS, num_kv_heads, head_dim, generator=g) * 100)
    slots += [-1] * NUM_UNOWNED_TOKENS
    q_lens = torch.tensor([q for _, q in spec])
    return Batch(
        query=torch.cat(queries).to(dtype), new_k=torch.cat(new_k).to(dtype),
        new_v=torch.cat(new_v).to(dtype), slot_mapping=torch.tensor(slots, dtype=torch.int64),
        k_cache=k_cache.to(dtype), v_cache=v_cache.to(dtype), block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32),
        max_query_len=int(q_lens.max()), max_seq_len=max(seq_lens),
        logical_k=logical_k, logical_v=logical_v,
    )


def naive_attention(batch: Batch) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], fp64
    """Per-sequence dense causal SDPA on the logical K/V, in float64."""
    num_heads = batch.query.shape[1]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    qsl = batch.query_start_loc.tolist()
    for b, n in enumerate(batch.seq_lens.tolist()):
        q = batch.query[qsl[b]: qsl[b + 1]].double()  # [q_len, num_heads, head_dim]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        k, v = batch.logical_k[b].double(), batch.logical_v[b].double()  # [n, kv_heads, dim]
        q_pos = torch.arange(n - q_len, n)[:, None]
        mask = torch.arange(n)[None, :] <= q_pos  # [q_len, n]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            enable_gqa=k.shape[1] != num_heads)  # [num_heads, q_len, head_dim]
        out[qsl[b]: qsl[b + 1]] = o.transpose(0, 1)
    return out


HEAD_CONFIGS = [(9, 3), (4, 4)]  # GQA ratio 3 (SmolLM2-like) and MHA


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=["gqa9x3", "mha4"])
def test_reference_matches_naive(page_size: int, heads: tuple[int, int]) -> None:
    batch = make_batch(MIXED_BATCH, *heads, head_dim=32, page_size=page_size)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv_ref(batch.new_k, batch.new_v, k_cache, v_cache, batch.slot_mapping)
    out = paged_attention_ref(*batch.attn_args(k_cache, v_cache))
    expected = naive_attention(batch)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert out[-NUM_UNOWNED_TOKENS:].abs().max() == 0


def test_write_kv_ref_skips_padding_rows() -> None:
    batch = make_batch(MIXED_BATCH, 9, 3, head_dim=32, page_size=3)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    slots = batch.slot_mapping.clone()
    slots[[0, 5, 17]] = -1  # padding rows in the middle too, not only at the end
    write_kv_ref(batch.new_k, batch.new_v, k_cache, v_cache, slots)
    exp_k = batch.k_cache.clone().view(-1, 3, 32)
    exp_v = batch.v_cache.clone().view(-1, 3, 32)
    for t, s in enumerate(slots.tolist()):  # independent per-row reconstruction
        if s >= 0:
            exp_k[s], exp_v[s] = batch.new_k[t], batch.new_v[t]
    assert torch.equal(k_cache.view(-1, 3, 32), exp_k)
    assert torch.equal(v_cache.view(-1, 3, 32), exp_v)
    # All-padding write is a no-op.
    before = k_cache.clone(), v_cache.clone()
    write_kv_ref(batch.new_k, batch.new_v, k_cache, v_cache, torch.full_like(slots, -1))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


# ---------------------------------------------------------------------------------------------
# Triton kernels under TRITON_INTERPRET=1. The interpreter must be selected before triton is
# imported, so the checks run in a fresh subprocess (this file run as a script) and report JSON;
# the pytest process itself never sees the env var.
# (name, page_size, heads, head_dim, dtype, forced number of KV splits or None)
TRITON_CASES = [
    ("p1_gqa_fp32", 1, (9, 3), 32, "float32", None),
    ("p16_gqa_fp32", 16, (9, 3), 64, "float32", None),
    ("p3_mha_fp32", 3, (4, 4), 32, "float32", None),
    ("p16_gqa_fp32_split4", 16, (9, 3), 32, "float32", 4),
    # LONG_BATCH: every split has keys; 8 splits of [64 rows, 32] tiles are merged (fused) in
    # two chunks of 4
    ("p16_gqa_fp32_long_split8", 16, (9, 3), 32, "float32", 8),
    ("p5_gqa_bf16_long_split4", 5, (6, 2), 64, "bfloat16", 4),
    ("p3_mha_fp32_split2", 3, (4, 4), 32, "float32", 2),
    ("p16_gqa_fp16", 16, (9, 3), 32, "float16", None),
    ("p5_gqa_bf16_split2", 5, (6, 2), 128, "bfloat16", 2),
    # q as a strided view (the decoder ropes q and k as one tensor and passes the q slice)
    ("p16_gqa_fp32_strided_q", 16, (9, 3), 32, "float32", None),
    ("p4_gqa_fp32_strided_q_split4", 4, (9, 3), 32, "float32", 4),
]
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 6e-2}
# Tree attention: (name, page_size, forced KV splits or None, longer prefix); fp32, GQA 9/3,
# head_dim 32. A 21-token prefix puts every key in the first split; 600 tokens fill all 16
# splits of the last case (the fused merge then takes two chunks of 8 live splits).
TREE_CASES = [("tree_p1", 1, None, 21), ("tree_p4_split2", 4, 2, 21), ("tree_p16", 16, None, 21),
              ("tree_p4_long_split4", 4, 4, 300), ("tree_p4_long_split16", 4, 16, 600),
              ("tree_p4_mixed", 4, None, 21), ("tree_p4_mixed_split4", 4, 4, 300)]


def _one_node_second(q, tables, starts, mask, n: int, page_size: int):
    """A step mixing a tree and a plain decode: the second sequence is a one-node request (one
    row, seeing its prefix and itself) whose keys and block table end after that row; its
    table entries past there are poisoned, so a kernel reading them would fault."""
    tables = tables.clone()
    tables[1, -(-(int(starts[1]) + 1) // page_size):] = 1 << 30
    mask = torch.cat([mask[:n], torch.nn.functional.one_hot(torch.tensor([0]), n).bool()])
    seq_lens = torch.stack([starts[0] + n, starts[1] + 1]).int()
    return q[:n + 1], tables, mask, torch.tensor([0, n, n + 1], dtype=torch.int32), seq_lens


def _tree_batch(page_size: int, seed: int, prefix: int = 21):
    """Two sequences (prefixes of 7 and ``prefix`` tokens) with random 6-node trees over a paged
    cache."""
    from compiled_spec.spec.tree import ancestor_mask

    g = torch.Generator().manual_seed(seed)
    n = 6
    width = (prefix + n) // page_size + 1
    blocks = max(64, 2 * width)
    k = torch.randn(blocks, page_size, 3, 32, generator=g)
    v = torch.randn(blocks, page_size, 3, 32, generator=g)
    starts = torch.tensor([7, prefix], dtype=torch.int32)
    tables = torch.randperm(blocks, generator=g)[:2 * width].view(2, width).int()
    parents = torch.tensor([[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in
                                    range(1, n)] for _ in range(2)])
    mask = ancestor_mask(parents).reshape(2 * n, n)
    q = torch.randn(2 * n, 9, 32, generator=g)
    qsl = torch.tensor([0, n, 2 * n], dtype=torch.int32)
    return q, k, v, tables, starts, mask, qsl, n


def _triton_worker() -> None:
    from kernels.attention_triton import _paged_attention, write_kv_triton

    results = {}
    for name, page_size, heads, head_dim, dtype_name, splits in TRITON_CASES:
        dtype = getattr(torch, dtype_name)
        batch = make_batch(LONG_BATCH if "_long" in name else MIXED_BATCH, *heads,
                           head_dim=head_dim, page_size=page_size, dtype=dtype, seed=len(results))
        if "strided_q" in name:  # same values, row stride (heads + kv_heads) * head_dim
            q = batch.query
            wide = torch.cat([q, torch.randn(q.shape[0], heads[1], head_dim).to(dtype)], dim=1)
            batch.query = wide[:, :heads[0]]
            assert not batch.query.is_contiguous()
        ref_k, ref_v = batch.k_cache.clone(), batch.v_cache.clone()
        write_kv_ref(batch.new_k, batch.new_v, ref_k, ref_v, batch.slot_mapping)
        tri_k, tri_v = batch.k_cache.clone(), batch.v_cache.clone()
        write_kv_triton(batch.new_k, batch.new_v, tri_k, tri_v, batch.slot_mapping)
        write_ok = torch.equal(tri_k, ref_k) and torch.equal(tri_v, ref_v)
        ref = paged_attention_ref(*batch.attn_args(ref_k, ref_v)).float()
        # `out` starts as NaN: every row, the unowned ones included, must be written.
        nan_out = torch.full(batch.query.shape, float("nan"), dtype=dtype)
        tri = _paged_attention(*batch.attn_args(tri_k, tri_v), num_splits=splits, out=nan_out)
        results[name] = {
            "write_ok": write_ok,
            "dtype_ok": tri.dtype == dtype and tri.shape == batch.query.shape,
            "err_vs_ref": (tri.float() - ref).abs().max().item(),
            "err_vs_naive": (tri.double() - naive_attention(batch)).abs().max().item(),
            "unowned_max": tri[-NUM_UNOWNED_TOKENS:].float().abs().max().item(),
        }
        if splits:  # the split's merge: fused (last split merges) against the merge kernel
            from kernels.attention_merge_triton import FUSED_MERGE
            from kernels.attention_triton import split_counters

            # the default call above took the merge kernel unless FUSED_MERGE (interpreted
            # split calls cost 4-12 s each: not run twice)
            unfused = tri if not FUSED_MERGE else _paged_attention(
                *batch.attn_args(tri_k, tri_v), num_splits=splits, fused_merge=False,
                out=torch.full(batch.query.shape, float("nan"), dtype=dtype))
            fused = _paged_attention(*batch.attn_args(tri_k, tri_v), num_splits=splits,
                                     fused_merge=True,
                                     out=torch.full(batch.query.shape, float("nan"), dtype=dtype))
            results[name].update(
                fused_vs_unfused=(fused.float() - unfused.float()).abs().max().item(),
                fused_unowned_max=fused[-NUM_UNOWNED_TOKENS:].float().abs().max().item(),
                counters_zero=bool((split_counters(fused.device) == 0).all()))
    from kernels.attention_ref import paged_tree_attention_ref

    for name, page_size, splits, prefix in TREE_CASES:
        q, k, v, tables, starts, mask, qsl, n = _tree_batch(page_size, len(results), prefix)
        seq_lens = starts + n
        if "mixed" in name:
            q, tables, mask, qsl, seq_lens = _one_node_second(q, tables, starts, mask, n,
                                                              page_size)
        ref = paged_tree_attention_ref(q, k, v, tables, starts, mask, qsl, n, n, prefix + n, 0.2,
                                       seq_lens=seq_lens)
        errs = [(_paged_attention(q, k, v, tables, seq_lens, qsl, n, prefix + n, 0.2,
                                  num_splits=splits, tree_start=starts, tree_mask=mask,
                                  fused_merge=fused) - ref).abs().max().item()
                for fused in ((False, True) if splits else (False,))]
        results[name] = {"err_vs_ref": max(errs), "runs": len(errs)}
    # Start-up warm-up: every reachable launch configuration, on the engine's own caches.
    from kernels.launch import reachable_configs
    from kernels.warmup import warm_attention

    batch = make_batch(MIXED_BATCH, 9, 3, head_dim=32, page_size=16, dtype=torch.float32, seed=9)
    k0, v0 = batch.k_cache.clone(), batch.v_cache.clone()
    done = warm_attention(batch.k_cache, batch.v_cache, 9, 300, 700, force=True, sms=132)
    results["warmup"] = {
        "launched": [list(c) for c in done],
        "expected": [list(c) for c in reachable_configs(3, 3, 300, 700, 132)],
        "caches_untouched": torch.equal(batch.k_cache, k0) and torch.equal(batch.v_cache, v0),
        "off_cuda_noop": warm_attention(batch.k_cache, batch.v_cache, 9, 300, 700) == []}
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def triton_results() -> dict:
    return run_interpreted(__file__, "--triton-worker")


@pytest.mark.heavy
@pytest.mark.parametrize("case", [c[0] for c in TRITON_CASES])
def test_triton_kernels_match_reference(triton_results: dict, case: str) -> None:
    r = triton_results[case]
    tol = TOLERANCE[next(c[4] for c in TRITON_CASES if c[0] == case)]
    assert r["write_ok"], "write_kv_triton differs from write_kv_ref"
    assert r["dtype_ok"]
    assert r["err_vs_ref"] < tol, r
    assert r["err_vs_naive"] < tol, r
    assert r["unowned_max"] == 0, r


SPLIT_CASES = [c[0] for c in TRITON_CASES if c[5]]


@pytest.mark.heavy
@pytest.mark.parametrize("case", SPLIT_CASES)
def test_fused_split_merge_equals_merge_kernel(triton_results: dict, case: str) -> None:
    """The last split to finish merges (one kernel): the same rows as the separate merge
    kernel up to fp32 summation order, padding rows zeroed, and every tile counter back at 0
    for the next launch (a counter left at 1 would merge too early on the next call)."""
    r = triton_results[case]
    assert r["fused_vs_unfused"] < 1e-5, r
    assert r["fused_unowned_max"] == 0, r
    assert r["counters_zero"], r


@pytest.mark.heavy
@pytest.mark.parametrize("case", [c[0] for c in TREE_CASES])
def test_triton_tree_attention_matches_reference(triton_results: dict, case: str) -> None:
    """Split cases run both merges (the merge kernel and the last split's)."""
    r = triton_results[case]
    assert r["err_vs_ref"] < 1e-4, r
    assert r["runs"] == (2 if next(c[2] for c in TREE_CASES if c[0] == case) else 1), r


# ---------------------------------------------------------------------------------------------
def test_custom_ops_under_torch_compile() -> None:
    import kernels.ops  # noqa: F401  registers torch.ops.compiled_spec.*

    batch = make_batch(MIXED_BATCH, 9, 3, head_dim=32, page_size=16)
    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))

    def step(query, new_k, new_v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, qsl):
        torch.ops.compiled_spec.write_kv(new_k * 1.5, new_v, k_cache, v_cache, slot_mapping)
        out = torch.ops.compiled_spec.paged_attention(
            query @ w, k_cache, v_cache, block_tables, seq_lens, qsl,
            batch.max_query_len, batch.max_seq_len, 0.125)
        return torch.relu(out) + 1.0

    def run(fn):
        k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
        out = fn(batch.query, batch.new_k, batch.new_v, k_cache, v_cache, batch.slot_mapping,
                 batch.block_tables, batch.seq_lens, batch.query_start_loc)
        return out, k_cache, v_cache

    eager_out, eager_k, eager_v = run(step)
    torch._dynamo.reset()
    comp_out, comp_k, comp_v = run(torch.compile(step, fullgraph=True, backend="inductor"))
    torch.testing.assert_close(comp_out, eager_out, atol=1e-5, rtol=1e-5)
    # The mutation inside the compiled graph must land in the caller's cache tensors.
    assert torch.equal(comp_k, eager_k) and torch.equal(comp_v, eager_v)
    assert not torch.equal(comp_k, batch.k_cache)
    valid = batch.slot_mapping >= 0
    torch.testing.assert_close(comp_k.view(-1, 3, 32)[batch.slot_mapping[valid]],
                               batch.new_k[valid] * 1.5)


if __name__ == "__main__" and "--triton-worker" in sys.argv:
    _triton_worker()


@pytest.mark.heavy
def test_warmup_launches_every_reachable_configuration(triton_results: dict) -> None:
    r = triton_results["warmup"]
    assert r["launched"] == r["expected"] and len(r["expected"]) == 3 * 5, r  # 3 block_q x 5 splits
    assert r["caches_untouched"] and r["off_cuda_noop"]
