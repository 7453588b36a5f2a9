"""Launch configuration of the skinny GEMM (``kernels.skinny_gemm_triton``), as pure functions of
(M, N, K), tested on the CPU and enumerated by the benchmark (``kernels.bench_gemm``).

Why skinny: at batch-1 decode / verify (M = 1..48 rows) SmolLM2's per-layer GEMMs read 0.7-3.5 MB
of weights, 0.2-0.8 us at the H200's bandwidth, yet cuBLAS ran them at ~3.9 us with 64-wide N
tiles: 9-48 CTAs on 132 SMs. So the policy is many CTAs of narrow N tiles, the whole M in one
tile (every weight byte is read once), and split-K only where N alone cannot fill the GPU.

Every distinct config is a separate Triton binary (per prologue and dtype too), and a binary
first met inside serving costs a JIT compile, so the candidate list is deliberately short and
``block_m`` takes few values (M itself is kept off the specialisation key in the kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_M = 64  # rows one launch handles; larger M goes to cuBLAS (prefill)
SMS = 132  # H200 multiprocessors: the CTA count the policy aims to cover


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
                f"w{self.num_warps}")


def block_m_for(m: int, use_dot: bool = True) -> int:
    if not 1 <= m <= MAX_M:
        raise ValueError(f"skinny GEMM handles 1..{MAX_M} rows, got M={m}")
    return max(16, _next_pow2(m)) if use_dot else _next_pow2(m)


def _split_for(tiles: int, k: int, block_k: int) -> int:
    """Split K only where the N tiles leave most SMs idle and K is long enough that each split
    still runs several iterations: the reducing launch costs ~1-2 us of dependent latency."""
    if tiles >= SMS // 2 or k < 1024:
        return 1
    split = _next_pow2(_cdiv(SMS, tiles))
    while split > 1 and _cdiv(k, block_k) < 4 * split:
        split //= 2
    return min(split, 4)


def gemm_config(m: int, n: int, k: int) -> GemmConfig:
    """The configuration the op launches for one call. Untuned beyond reasoning so far: the
    H200 benchmark (``python -m kernels.bench_gemm``) prints which candidate wins per shape."""
    block_n = 16 if n <= 4096 else 64  # narrow tiles for the layer GEMMs; lm_head has plenty
    block_k = 64
    split = _split_for(_cdiv(n, block_n), k, block_k)
    return GemmConfig(block_m_for(m), block_n, block_k, split)


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
    if m <= 8:  # GEMV-like: no padding of M to 16 rows; the [bm, bn, bk] product stays in
        bm = block_m_for(m, False)  # registers (<= 128 fp32 per thread at 4 warps)
        out += [GemmConfig(bm, bn, bk, use_dot=False) for bk in (32, 64, 128)
                if bm * bn * bk <= 16384]
    seen: set[GemmConfig] = set()
    return [c for c in out if not (c in seen or seen.add(c))]
