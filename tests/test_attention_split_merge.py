"""The split-KV merge fused into the paged-attention kernel ("last split merges",
kernels/attention_merge_triton.py) against the reference, under the Triton CPU interpreter.

Shapes are those of speculative decoding on SmolLM2 (GQA 9/3): decode (q 1), verification
(q 6), a prefill chunk (q 32, two query blocks), batches of 1 and 3, contexts shorter than one
split (later splits see no key and must still be counted) and spanning many, padding sequences
(q_len 0, seq_len 0) and trailing padding token rows (slot -1) that must come out 0. Every case
is called twice on the same counter buffer with different queries: a counter left non-zero by
the first call would make the second merge at the wrong time (or never), leaving rows stale.

The interpreter runs a grid's programs one after another, so it checks the arithmetic and the
counting, not the memory ordering between SMs; ``python -m kernels.bench_attention --merge``
checks that on a GPU under CUDA-graph replay.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the Triton worker runs this file as a script
    sys.path.insert(0, str(REPO_ROOT))

from tests.test_attention_kernels import (  # noqa: E402
    NUM_UNOWNED_TOKENS, TOLERANCE, make_batch, naive_attention)
from tests.triton_interpret import run_interpreted  # noqa: E402

PAD = (0, 0)  # a padding sequence of a captured batch: no query token, no context
# (name, (context, q_len) per sequence, head_dim, page_size, dtype, forced KV splits)
CASES: list[tuple[str, list[tuple[int, int]], int, int, str, int]] = [
    ("b1_q1_ctx_in_one_split", [(20, 1)], 64, 16, "float32", 4),  # splits 1..3 empty
    ("b1_q1_ctx_spans_splits", [(300, 1)], 64, 16, "float32", 4),
    ("b1_q1_16_splits_chunked", [(1100, 1)], 64, 16, "float32", 16),  # 4 chunks of 4
    ("b1_q6", [(200, 6)], 64, 16, "float32", 8),
    ("b1_q32_two_q_blocks", [(150, 32)], 64, 16, "float32", 4),
    ("b3_q1_pad", [(10, 1), (250, 1), PAD], 64, 16, "float32", 4),
    ("b3_q6_pad", [(70, 6), (3, 6), (190, 6), PAD], 64, 5, "float32", 4),
    ("b3_q32", [(0, 32), (100, 32), (40, 32)], 32, 16, "float32", 2),
    ("b3_q6_one_split", [(70, 6), (3, 6), PAD, (190, 6)], 64, 16, "float32", 1),
    ("b3_q6_bf16", [(70, 6), (130, 6), (5, 6)], 64, 16, "bfloat16", 4),
]


def _poison_empty() -> None:
    """Float torch.empty returns NaN-filled memory in this worker process: a row the kernels
    leave unwritten (a merge that never ran, a padding row not zeroed) cannot pass as zeros or
    as the previous call's values that fresh or reused CPU memory may happen to hold."""
    real_empty = torch.empty

    def empty(*size, **kw):
        t = real_empty(*size, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = empty


def _worker() -> None:
    from kernels import attention_merge_triton as merge
    from kernels.attention_ref import paged_attention_ref, write_kv_ref
    from kernels.attention_triton import _paged_attention

    _poison_empty()
    results = {}
    for i, (name, spec, head_dim, page_size, dtype_name, splits) in enumerate(CASES):
        dtype = getattr(torch, dtype_name)
        batch = make_batch(spec, 9, 3, head_dim=head_dim, page_size=page_size, dtype=dtype,
                           seed=100 + i)
        write_kv_ref(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, batch.slot_mapping)
        r: dict = {}
        for call in ("first", "second"):
            if call == "second":  # new queries, same caches, same counters
                g = torch.Generator().manual_seed(7 + i)
                batch.query = torch.randn(batch.query.shape, generator=g).to(dtype)
            ref = paged_attention_ref(*batch.attn_args()).float()
            fused = _paged_attention(*batch.attn_args(), num_splits=splits, fused_merge=True)
            r[f"{call}_err_vs_ref"] = (fused.float() - ref).abs().max().item()
            r[f"{call}_err_vs_naive"] = (fused.double() - naive_attention(batch)).abs().max().item()
            r[f"{call}_unowned_max"] = fused[-NUM_UNOWNED_TOKENS:].float().abs().max().item()
            r[f"{call}_finite"] = bool(fused.isfinite().all())
            r[f"{call}_counters_zero"] = all(int(c.count_nonzero()) == 0
                                             for c in merge._COUNTERS.values())
        two = _paged_attention(*batch.attn_args(), num_splits=splits, fused_merge=False)
        r["fused_vs_two_kernel"] = (fused.float() - two.float()).abs().max().item()
        r["dtype_ok"] = fused.dtype == dtype and fused.shape == batch.query.shape
        results[name] = r
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(__file__, "--worker")


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_fused_merge_matches_reference(results: dict, case: str) -> None:
    r = results[case]
    tol = TOLERANCE[next(c[4] for c in CASES if c[0] == case)]
    assert r["dtype_ok"], r
    for call in ("first", "second"):  # the second call finds the counters the first left
        assert r[f"{call}_finite"], r
        assert r[f"{call}_err_vs_ref"] < tol, (call, r)
        assert r[f"{call}_err_vs_naive"] < tol, (call, r)
        assert r[f"{call}_unowned_max"] == 0, (call, r)
        assert r[f"{call}_counters_zero"], (call, r)
    assert r["fused_vs_two_kernel"] < tol, r


def test_split_counters_grow_and_keep_captured_buffers_alive() -> None:
    from kernels import attention_merge_triton as merge

    saved, retired = dict(merge._COUNTERS), list(merge._RETIRED)
    try:
        merge._COUNTERS.clear()
        cpu = torch.device("cpu")
        first = merge.split_counters(cpu, 10)
        assert first.numel() == merge.MIN_COUNTERS and first.dtype == torch.int32
        assert int(first.count_nonzero()) == 0
        assert merge.split_counters(cpu, merge.MIN_COUNTERS) is first  # reused, not reallocated
        bigger = merge.split_counters(cpu, merge.MIN_COUNTERS + 1)
        assert bigger.numel() >= merge.MIN_COUNTERS + 1 and int(bigger.count_nonzero()) == 0
        # a graph captured with the old buffer still points at it: it must stay allocated
        assert any(t is first for t in merge._RETIRED)
    finally:
        merge._COUNTERS.clear()
        merge._COUNTERS.update(saved)
        merge._RETIRED[:] = retired


@pytest.mark.parametrize("splits,rows,dim,want", [
    (1, 16, 64, 1), (2, 16, 64, 2), (8, 16, 64, 4), (16, 16, 64, 4), (4, 64, 64, 1),
    (64, 16, 128, 2), (2, 64, 128, 1)])
def test_merge_chunk_divides_splits_and_bounds_the_tile(splits, rows, dim, want) -> None:
    from kernels.attention_merge_triton import MERGE_TILE, merge_chunk

    c = merge_chunk(splits, rows, dim)
    assert c == want and splits % c == 0 and (c == 1 or c * rows * dim <= MERGE_TILE)


def test_merge_benchmark_dry_run_on_the_cpu() -> None:
    """The GPU comparison (``python -m kernels.bench_attention --merge``) keeps working: its CPU
    dry run (Triton interpreter, tiny sizes, H200 split counts) checks both merges."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-m", "kernels.bench_attention", "--merge",
                           "--dry-run"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and "all checks passed" in proc.stdout, (
        proc.stdout[-3000:] + proc.stderr[-3000:])
    assert "2-kernel" in proc.stdout and "fused" in proc.stdout
