"""Check the Triton paged-KV kernels against the reference and time decode attention on a GPU.

``python -m kernels.bench_attention``: correctness sweep, decode timings, and the split-merge
comparison below. ``--merge``: only that comparison (issue 16): the two-kernel split merge
against the merge fused into the attention kernel, for SmolLM2 shapes (batch 1 and 4, q len 1, 6
and 32, contexts 128, 512, 2048), each checked against the reference after repeated CUDA-graph
replays (the fused path's arrival counters must come back to 0 every time). ``--merge
--dry-run`` runs that comparison on the CPU under the Triton interpreter on tiny sizes, with the
H200's split counts forced, to show the code path works; its times mean nothing.
Needs CUDA otherwise; on a CPU-only machine it just says so. Timings replay a CUDA graph of
several calls, so they show GPU time rather than Python launch overhead (the engine runs these
kernels inside CUDA graphs too).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "--dry-run" in sys.argv and os.environ.get("TRITON_INTERPRET") != "1":
    # the interpreter is chosen when triton is imported, i.e. by the imports just below
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from kernels import attention_merge_triton as merge  # noqa: E402
from kernels.attention_ref import paged_attention_ref, write_kv_ref  # noqa: E402
from kernels.attention_triton import (  # noqa: E402
    _paged_attention, num_sms, paged_attention_triton, write_kv_triton)
from kernels.launch import attention_launch  # noqa: E402

PAGE_SIZE = 16
SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # (num_heads, num_kv_heads, head_dim)


def make_batch(spec: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, page_size: int = PAGE_SIZE, seed: int = 0,
               dev: str = "cuda") -> dict:
    """spec: (context already cached, new query tokens) per sequence; blocks are shuffled."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in spec]
    nblk = [-(-n // page_size) for n in seq_lens]
    num_blocks = sum(nblk) + 1
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(spec), max(nblk), dtype=torch.int32)
    slots, used = [], 0
    for b, ((ctx, q), n) in enumerate(zip(spec, seq_lens)):
        block_tables[b, : nblk[b]] = perm[used: used + nblk[b]].to(torch.int32)
        used += nblk[b]
        pos = torch.arange(ctx, n)
        slots.append(block_tables[b, pos // page_size].long() * page_size + pos % page_size)
    q_lens = torch.tensor([q for _, q in spec])
    num_tokens = int(q_lens.sum())
    return dict(
        query=torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dev, dtype),
        key=torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dev, dtype),
        value=torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dev, dtype),
        k_cache=torch.randn(num_blocks, page_size, num_kv_heads, head_dim, generator=g).to(dev, dtype),
        v_cache=torch.randn(num_blocks, page_size, num_kv_heads, head_dim, generator=g).to(dev, dtype),
        slot_mapping=torch.cat(slots).to(dev),
        block_tables=block_tables.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(dev, torch.int32),
        max_query_len=int(q_lens.max()), max_seq_len=max(seq_lens), scale=head_dim ** -0.5,
    )


def attn_args(b: dict) -> tuple:
    return (b["query"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
            b["query_start_loc"], b["max_query_len"], b["max_seq_len"], b["scale"])


def check() -> bool:
    # Prefill (fresh and chunked), decode, padding sequence, verification of 4 and 8 tokens.
    spec = [(0, 100), (37, 200), (500, 1), (0, 1), (9, 0), (1000, 4), (63, 8), (2000, 1)]
    ok = True
    print("correctness: max |triton - ref| on a mixed prefill/decode/verify batch")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)):
        for (name, (h, kvh, d)) in SHAPES.items():
            for page_size in (1, 16, 5):
                b = make_batch(spec, h, kvh, d, dtype, page_size=page_size)
                ref_k, ref_v = b["k_cache"].clone(), b["v_cache"].clone()
                write_kv_ref(b["key"], b["value"], ref_k, ref_v, b["slot_mapping"])
                write_kv_triton(b["key"], b["value"], b["k_cache"], b["v_cache"], b["slot_mapping"])
                write_ok = torch.equal(ref_k, b["k_cache"]) and torch.equal(ref_v, b["v_cache"])
                ref = paged_attention_ref(*attn_args(b)).float()
                errs = []
                # heuristic, forced single pass, forced split-KV (fused merge), two-kernel merge
                for splits, fused in ((None, None), (1, None), (4, True), (4, False)):
                    out = _paged_attention(*attn_args(b), num_splits=splits, fused_merge=fused)
                    errs.append((out.float() - ref).abs().max().item())
                good = write_ok and max(errs) < tol
                ok &= good
                print(f"  {str(dtype):15s} {name:8s} page={page_size:<3d} write_kv "
                      f"{'ok' if write_ok else 'MISMATCH'}  attn err (auto/1/4 fused/4 two-kernel) "
                      + " / ".join(f"{e:.2e}" for e in errs) + ("" if good else "  FAIL"))
    return ok


def time_graph(fn, reps: int = 20, iters: int = 10) -> float:
    """Mean microseconds per call: replay a CUDA graph holding `reps` calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (reps * iters)


def bench() -> None:
    print("\ndecode (q_len 1, page 16, bf16); us per call from CUDA-graph replay")
    print(f"{'shape':8s} {'batch':>5s} {'ctx':>5s} {'triton':>8s} {'1-split':>8s} {'ref':>8s}"
          f" {'KV GB/s':>8s}")
    for name, (h, kvh, d) in SHAPES.items():
        for batch in (1, 16):
            for ctx in (512, 2048):
                b = make_batch([(ctx - 1, 1)] * batch, h, kvh, d, torch.bfloat16)
                args = attn_args(b)
                t_tri = time_graph(lambda: paged_attention_triton(*args))
                t_one = time_graph(lambda: _paged_attention(*args, num_splits=1))
                try:  # the reference is plain PyTorch; capture is not its design goal
                    t_ref = time_graph(lambda: paged_attention_ref(*args), reps=2, iters=3)
                except RuntimeError:
                    t_ref = float("nan")
                kv_bytes = 2 * batch * ctx * kvh * d * 2  # K and V, bf16
                print(f"{name:8s} {batch:5d} {ctx:5d} {t_tri:8.1f} {t_one:8.1f} {t_ref:8.1f}"
                      f" {kv_bytes / t_tri / 1e3:8.0f}")


def replay_error(fn, ref: torch.Tensor, replays: int = 50) -> float:
    """Max |out - ref| over ``replays`` replays of a CUDA graph holding one call (each replay
    rewrites the same static output; a counter not reset, or a merge that read a partial
    before its split had written it, shows as a mismatch in some replay)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    worst = 0.0
    for _ in range(replays):
        graph.replay()
        worst = max(worst, (out.float() - ref).abs().max().item())
    return worst


def bench_merge(dry_run: bool = False) -> bool:
    """Two-kernel vs fused split merge on SmolLM2 shapes; returns whether every result matched
    the reference (bf16 on the GPU; fp32 under the CPU interpreter)."""
    h, kvh, d = SHAPES["smollm2"]
    dev = "cpu" if dry_run else "cuda"
    dtype, tol = (torch.float32, 1e-4) if dry_run else (torch.bfloat16, 3e-2)
    batches, q_lens, ctxs = ((1, 2), (1, 6), (128,)) if dry_run else ((1, 4), (1, 6, 32),
                                                                      (128, 512, 2048))
    sms = 132 if dry_run else num_sms(torch.empty(0, device=dev))  # H200's split counts on CPU
    print(f"\nsplit merge, smollm2 (heads {h}/{kvh}, dim {d}), {dtype}, page {PAGE_SIZE}; us per "
          + ("call, wall clock under the Triton interpreter (meaningless)" if dry_run
             else "call from CUDA-graph replay"))
    print(f"{'batch':>5s} {'q':>3s} {'ctx':>5s} {'splits':>6s} {'2-kernel':>9s} {'fused':>8s}"
          f" {'saved':>7s} {'err 2-k':>8s} {'err fused':>9s}")
    ok = True
    for batch in batches:
        for q in q_lens:
            for ctx in ctxs:
                b = make_batch([(ctx, q)] * batch, h, kvh, d, dtype, dev=dev)
                args = attn_args(b)
                splits = attention_launch(h // kvh, kvh, batch, q, ctx + q, sms).num_splits
                forced = splits if dry_run else None  # the GPU picks the same by itself
                ref = paged_attention_ref(*args).float()
                row = {}
                for name, fused in (("two", False), ("fused", True)):
                    def call(fused=fused):
                        return _paged_attention(*args, num_splits=forced, fused_merge=fused)
                    if dry_run:  # the graph replays become two calls back to back
                        err = max((call().float() - ref).abs().max().item() for _ in range(2))
                        t0 = time.perf_counter()
                        call()
                        t = (time.perf_counter() - t0) * 1e6
                    else:
                        err = replay_error(call, ref)
                        t = time_graph(call)
                    row[name] = (t, err)
                counters_zero = all(int(c.count_nonzero()) == 0
                                    for c in merge._COUNTERS.values())
                good = max(row["two"][1], row["fused"][1]) < tol and counters_zero
                ok &= good
                print(f"{batch:5d} {q:3d} {ctx:5d} {splits:6d} {row['two'][0]:9.2f}"
                      f" {row['fused'][0]:8.2f} {row['two'][0] - row['fused'][0]:7.2f}"
                      f" {row['two'][1]:8.1e} {row['fused'][1]:9.1e}"
                      + ("" if good else "  FAIL" + ("" if counters_zero else " (counters)")))
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--merge", action="store_true", help="only the split-merge comparison")
    ap.add_argument("--dry-run", action="store_true",
                    help="the split-merge comparison on the CPU (Triton interpreter, tiny sizes)")
    a = ap.parse_args(argv)
    if a.dry_run:
        ok = bench_merge(dry_run=True)
        print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
        return 0 if ok else 1
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU (Triton kernels); none found, nothing to do.")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = True
    if not a.merge:
        ok = check()
        bench()
    ok &= bench_merge()
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
