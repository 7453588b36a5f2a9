"""Launch configuration of the skinny GEMM (``kernels.skinny_gemm_triton``), as pure functions of
(M, N, K), tested on the CPU and enumerated by the benchmark (``kernels.bench_gemm``).

Why skinny: at batch-1 decode / verify (M = 1..48 rows) SmolLM2's per-layer GEMMs read 0.7-3.5 MB
of weights, 0.2-0.8 us at the H200's bandwidth, yet cuBLAS ran them at ~3.9 us with 64-wide N
tiles: 9-48 CTAs on 132 SMs. So the policy is many CTAs of narrow N tiles, the whole M in one
tile (every weight byte is read once). Split-K (a second, reducing launch) is a benchmark
candidate only: it lost on every H200 shape.

Every distinct config is a separate Triton binary (per prologue and dtype too), and a binary
first met inside serving costs a JIT compile, so the candidate list is deliberately short and
``block_m`` takes few values (M itself is kept off the specialisation key in the kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_M = 64  # rows one tile holds, and rows the ops take by default; larger M goes to cuBLAS
# With the wide option (``kernels.dispatch.skinny_wide_scope``): up to this many rows go through
# the fused kernels in tiles of MAX_M (each weight byte read once per tile, from L2 after the
# first). For verifies past 64 rows (a tree's 48 nodes x 4 requests, a chain's 6 x 16), which
# otherwise run the unfused path: cuBLAS plus the norm, SiLU-and-mul and rope + KV kernels.
WIDE_MAX_M = 256
# K from which the pick takes the deep-K tiles (the 8B shape's 4096 and 14336 did; SmolLM2's
# K = 576 and 1536 keep the tiles measured for them)
DEEP_K = 2048
# Rows of a tile up to which deep K takes 256-deep steps (measured at M = 1..8): the A tile, the
# norm prologue's [BLOCK_M, BLOCK_K] fp32 squares and the paired gate_up's two weight tiles grow
# with it, and at 64 rows they would pass the SM's shared memory and registers.
DEEP_K_MAX_BLOCK_M = 16


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GemmConfig:
    block_m: int  # >= M; 16..64 with tl.dot (its minimum M is 16), any power of two without
    block_n: int
    block_k: int
    split_k: int = 1  # > 1: fp32 partials [split_k, M, N] and a second, reducing launch
    use_dot: bool = True  # False: CUDA-core FMA (broadcast product + sum), for M <= 8
    num_warps: int = 4
    num_stages: int = 3

    @property
    def name(self) -> str:
        kind = "dot" if self.use_dot else "fma"
        return (f"{kind} m{self.block_m} n{self.block_n} k{self.block_k} s{self.split_k} "
                f"w{self.num_warps} p{self.num_stages}")


def block_m_for(m: int, use_dot: bool = True) -> int:
    """Rows of one tile for M rows (M > MAX_M: tiles of MAX_M)."""
    if not 1 <= m <= WIDE_MAX_M:
        raise ValueError(f"skinny GEMM handles 1..{WIDE_MAX_M} rows, got M={m}")
    m = min(m, MAX_M)
    return max(16, _next_pow2(m)) if use_dot else _next_pow2(m)


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The configuration the op launches for one call, from the H200 benchmark of the eleventh
    session (``profiles/results/2026-12-02_h200_session11/gemm.md``, M = 1..48): for the layer
    GEMMs (N <= 4096) 16-wide N tiles with 128-deep K steps in 4 stages and no split-K won every
    shape (qkv 3.34 us vs cuBLAS 3.66, o_proj 3.30 vs 3.58, gate_up 4.09 vs 4.04, down 5.22 vs
    5.00); the tenth session's 64-deep steps and split-K for down ran 4.5-5.7 us. Split-K lost
    everywhere it was tried (its reducing launch), so the pick never splits; ``candidates`` keeps
    it for the benchmark. lm_head: 64-wide tiles, 64-deep steps (15.9-16.5 us vs cuBLAS 16.4-17.0).

    Deep K (the Llama-3.1-8B shape, K = 4096 and 14336; H100, forty-fifth session,
    ``profiles/results/2026-12-06_h100_session45/``, M = 1 and 4): 256-deep K steps won every
    layer GEMM, each then ahead of cuBLAS: qkv 19.9 us (cuBLAS 21.0; 30.3 with the 64-deep steps
    picked before), o_proj 14.9 (15.5), gate_up 81.4 (82.6), down 43.7 (44.0); 4 stages where
    the N tiles are few, 3 where they are many (gate_up's 448). Tiles of more than
    ``DEEP_K_MAX_BLOCK_M`` rows step 128 deep (the thirty-third session's best for wide N)."""
    bm = block_m_for(m)
    if k >= DEEP_K:
        bn = 16 if n <= 4096 else 64
        stages = 4 if n <= 8192 else 3
        return GemmConfig(bm, bn, 256 if bm <= DEEP_K_MAX_BLOCK_M else 128, num_stages=stages)
    if n <= 4096:
        return GemmConfig(bm, 16, 128, num_stages=4)
    return GemmConfig(bm, 64, 64)


def candidates(m: int, n: int, k: int) -> list[GemmConfig]:
    """A short list of reasonable configs for the benchmark; ``gemm_config``'s pick included."""
    bm = block_m_for(m)
    out = [gemm_config(m, n, k)]
    ns = (16, 32, 64) if n <= 4096 else (64, 128)
    for bn in ns:
        for bk in (64, 128):
            out.append(GemmConfig(bm, bn, bk))
    bn = ns[0]
    for split in (2, 4):
        if _cdiv(k, 64) >= 2 * split:
            out.append(GemmConfig(bm, bn, 64, split))
    out.append(GemmConfig(bm, bn, 64, num_warps=2))
    out.append(GemmConfig(bm, bn, 128, num_stages=4))
    if k >= DEEP_K:  # more bytes in flight per CTA: the 8B shape's qkv and o_proj ran at 70-78%
        # of the read bandwidth (cuBLAS and our best alike), short of what deep K allows
        out += [GemmConfig(bm, bn, 256, num_stages=st) for st in (3, 4)]
        out.append(GemmConfig(bm, bn, 128, num_stages=6))
    if m <= 8:  # GEMV-like: no padding of M to 16 rows; the [bm, bn, bk] product stays in
        bm = block_m_for(m, False)  # registers (<= 128 fp32 per thread at 4 warps)
        out += [GemmConfig(bm, bn, bk, use_dot=False) for bk in (32, 64, 128)
                if bm * bn * bk <= 16384]
    seen: set[GemmConfig] = set()
    return [c for c in out if not (c in seen or seen.add(c))]
