"""Check the Triton paged-KV kernels against the reference and time decode attention on a GPU.

Run as ``python -m kernels.bench_attention``. Needs CUDA; on a CPU-only machine it just says so.
Timings replay a CUDA graph of several calls, so they show GPU time rather than Python launch
overhead (the engine runs these kernels inside CUDA graphs too).
"""
from __future__ import annotations

import sys

import torch

from kernels.attention_ref import paged_attention_ref, write_kv_ref
from kernels.attention_triton import _paged_attention, paged_attention_triton, write_kv_triton
from kernels.graph_timer import graph_us

PAGE_SIZE = 16
SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # (num_heads, num_kv_heads, head_dim)


def make_batch(spec: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype, page_size: int = PAGE_SIZE, seed: int = 0) -> dict:
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
    dev = "cuda"
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
                # heuristic, single pass, forced split-KV merged by the last split (fused) and
                # by the separate merge kernel
                for splits, fused in ((None, None), (1, None), (4, True), (4, False)):
                    out = _paged_attention(*attn_args(b), num_splits=splits, fused_merge=fused)
                    errs.append((out.float() - ref).abs().max().item())
                good = write_ok and max(errs) < tol
                ok &= good
                print(f"  {str(dtype):15s} {name:8s} page={page_size:<3d} write_kv "
                      f"{'ok' if write_ok else 'MISMATCH'}  attn err (auto/1/4 fused/4 kernel) "
                      + " / ".join(f"{e:.2e}" for e in errs) + ("" if good else "  FAIL"))
    return ok & check_fused_merge_races()


def check_fused_merge_races(repeats: int = 300) -> bool:
    """The fused merge relies on GPU memory ordering (partials stored, then a release count;
    the last split acquires and reads them), which the CPU interpreter cannot exercise. Many
    launches, eager and replayed from a CUDA graph, must give bit-identical outputs (the merge
    order is fixed) and leave every tile counter at 0."""
    from kernels.attention_triton import split_counters

    ok = True
    print("fused split merge: bit-identical over repeats, counters back at 0")
    for q_len, ctx in ((1, 511), (6, 400), (32, 1500)):
        b = make_batch([(ctx, q_len)], 9, 3, 64, torch.bfloat16, seed=q_len)
        args = attn_args(b)
        first = _paged_attention(*args, num_splits=None, fused_merge=True)
        kernel = _paged_attention(*args, num_splits=None, fused_merge=False)
        same = all(torch.equal(_paged_attention(*args, num_splits=None, fused_merge=True), first)
                   for _ in range(repeats))
        graph, out = torch.cuda.CUDAGraph(), None
        with torch.cuda.graph(graph):
            out = _paged_attention(*args, num_splits=None, fused_merge=True)
        replay_same = True
        for _ in range(repeats):
            graph.replay()
            replay_same &= torch.equal(out, first)
        zero = bool((split_counters(first.device) == 0).all())
        err = (first.float() - kernel.float()).abs().max().item()
        good = same and replay_same and zero and err < 1e-2
        ok &= good
        print(f"  q_len {q_len:3d} ctx {ctx:5d}: eager same {same}, graph same {replay_same}, "
              f"counters 0 {zero}, |fused - merge kernel| {err:.2e}" + ("" if good else "  FAIL"))
    return ok


def time_graph(fn, reps: int = 20, iters: int = 10) -> float:
    """Mean microseconds per call: replay a CUDA graph holding `reps` calls."""
    return graph_us(lambda _: fn(), reps, iters)


def bench() -> None:
    print("\ndecode (q_len 1, page 16, bf16); us per call from CUDA-graph replay")
    print("(triton: the default, heuristic splits and the separate merge kernel; fused: the "
          "same splits merged by the last split, COMPILED_SPEC_FUSED_MERGE=1)")
    print(f"{'shape':8s} {'batch':>5s} {'q':>3s} {'ctx':>5s} {'triton':>8s} {'fused':>8s} "
          f"{'1-split':>8s} {'ref':>8s} {'KV GB/s':>8s}")
    for name, (h, kvh, d) in SHAPES.items():
        for batch, q_len in ((1, 1), (1, 6), (1, 32), (16, 1)):
            for ctx in (512, 2048):
                b = make_batch([(ctx - q_len, q_len)] * batch, h, kvh, d, torch.bfloat16)
                args = attn_args(b)
                t_tri = time_graph(lambda: paged_attention_triton(*args))
                t_two = time_graph(lambda: _paged_attention(*args, num_splits=None,
                                                            fused_merge=True))
                t_one = time_graph(lambda: _paged_attention(*args, num_splits=1))
                try:  # the reference is plain PyTorch; capture is not its design goal
                    t_ref = time_graph(lambda: paged_attention_ref(*args), reps=2, iters=3)
                except RuntimeError:
                    t_ref = float("nan")
                kv_bytes = 2 * batch * ctx * kvh * d * 2  # K and V, bf16
                print(f"{name:8s} {batch:5d} {q_len:3d} {ctx:5d} {t_tri:8.1f} {t_two:8.1f} "
                      f"{t_one:8.1f} {t_ref:8.1f} {kv_bytes / t_tri / 1e3:8.0f}")


def binaries() -> None:
    """Registers, spills and shared memory of the decode binaries, split kernel + merge against
    the fused merge: the fused form ran 2.8-9x slower than the split kernel and its merge on the
    H100 (forty-eighth session; 84.4 against 9.0 us for the 8B shape at 2048 tokens), slower
    than a single split even, though its merge loads a few KB. Compiled for sm_90 on the CPU
    (``profiles/scripts/kernel_regs_cpu.py``, fiftieth session) neither form spills; this
    reads the binaries the GPU's own Triton builds."""
    import kernels.attention_triton as at

    real, seen = at._paged_attn_kernel, []

    class Recorder:  # records what ``kernel[grid](...)`` returns: the compiled binary
        def __getitem__(self, grid):
            def launch(*a, **k):
                binary = real[grid](*a, **k)
                seen.append((grid, k, binary))
                return binary
            return launch

    print("\nattention binaries (decode, batch 1, bf16): registers / spills per thread, shared "
          "bytes")
    at._paged_attn_kernel = Recorder()
    try:
        for name, (h, kvh, d) in SHAPES.items():
            for ctx in (512, 2048):
                args = attn_args(make_batch([(ctx - 1, 1)], h, kvh, d, torch.bfloat16))
                for fused in (False, True):
                    seen.clear()
                    _paged_attention(*args, num_splits=None, fused_merge=fused)
                    grid, k, b = seen[-1]
                    meta = getattr(b, "metadata", None)
                    print(f"  {name:8s} ctx {ctx:5d} fused {fused!s:5s} grid {grid} splits "
                          f"{k['NUM_SPLITS']} chunk {k['MERGE_CHUNK']} block_q {k['BLOCK_Q']} "
                          f"regs {getattr(b, 'n_regs', '?')} spills {getattr(b, 'n_spills', '?')}"
                          f" shared {getattr(meta, 'shared', '?')} warps "
                          f"{getattr(meta, 'num_warps', '?')}")
    finally:
        at._paged_attn_kernel = real


def split_sweep() -> None:
    """Decode attention by forced split count: the heuristic splits down to one key block per
    program, which on the 8B shape cost 5.9 + 2.5 us (split kernel + merge) per layer in its
    decode graph (thirtieth session), against ~0.5 us of KV reads at 512 tokens."""
    splits = (1, 2, 4, 8, 16, 32)
    print("\ndecode (q_len 1, bf16) by forced split count; us per call from CUDA-graph replay")
    print(f"{'shape':8s} {'batch':>5s} {'ctx':>5s} {'heur':>7s} "
          + " ".join(f"{s:>7d}" for s in splits))
    for name, (h, kvh, d) in SHAPES.items():
        for batch, ctx in ((1, 512), (1, 2048), (4, 512), (16, 512)):
            args = attn_args(make_batch([(ctx - 1, 1)] * batch, h, kvh, d, torch.bfloat16))
            heur = time_graph(lambda: paged_attention_triton(*args))
            ts = [time_graph(lambda s=s: _paged_attention(*args, num_splits=s)) for s in splits]
            cells = " ".join(f"{t:7.1f}" for t in ts)
            print(f"{name:8s} {batch:5d} {ctx:5d} {heur:7.1f} {cells}")


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU (Triton kernels); none found, nothing to do.")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    ok = check()
    bench()
    binaries()
    split_sweep()
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
