"""Launch configuration of the paged-attention kernel, as pure functions (tested on the CPU).

Triton compiles one binary per combination of ``tl.constexpr`` values (and of its integer
specialisations: ==1, divisible by 16). A configuration first met while serving costs a JIT
compile, a few hundred milliseconds, inside that request: an uncaptured prefill of a new length
class (a new ``BLOCK_Q`` or ``NUM_SPLITS``) did exactly that on the H200, once per new prompt
length class. So the policy is written here once, used by the kernel wrapper, and enumerated by
``reachable_configs`` so that start-up can compile every configuration an engine can meet
(``kernels.warmup``). The integer arguments that vary per call are kept off the specialisation
key (``do_not_specialize`` in the kernels: the block-table row stride, the split buffers' token
stride, the sequence count of the merge kernel). Pointers are specialised on 16-byte alignment
too, and the engine's metadata (block tables, sequence lengths, query starts, slot mappings) are
views into packed buffers at any int32 offset, while the warm-up's are fresh tensors: each
binary the warm-up built was compiled again for the engine's first launch, 0.5-1.3 s each,
inside the capture of the decode, verify, draft and every prefill size (twenty-eighth
session's cold starts on the H200: ~4 s of SmolLM2's, ~7 s of the 8B shape's). Those pointers
are scalar loads, so the kernels take them with ``do_not_specialize_on_alignment``: one
binary whatever their offset.
"""
from __future__ import annotations

from dataclasses import dataclass

BLOCK_N = 64  # keys per inner-loop tile
MAX_SPLITS = 64


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class AttnLaunch:
    block_q: int  # query tokens per program (x group_pad score rows)
    num_splits: int  # programs per (sequence, q block, kv head) along the keys
    q_blocks: int
    kv_chunk: int  # keys per split, a multiple of BLOCK_N

    @property
    def key(self) -> tuple[int, int]:
        """What selects the compiled binary (with the model's fixed group / head_dim / dtype)."""
        return self.block_q, self.num_splits


def block_q_for(max_query_len: int, group_pad: int) -> int:
    """~64 score rows per program for prefill, but at least 16 (tl.dot's minimum M) for decode."""
    block_q = min(_next_pow2(max_query_len), max(1, 64 // group_pad))
    return max(block_q, _cdiv(16, group_pad))


def splits_for(programs: int, max_seq_len: int, sms: int | None) -> int:
    """Split the KV range only when the grid is too small to fill the GPU and keys are many
    (``sms`` None: not a GPU, no split). Down to one key block per split: a decode program is a
    chain of dependent loads (block table, then K, then V), so its time is set by iterations,
    not bytes; the H200 profile at batch 1 put 8.4 us per layer in attention with 4 blocks per
    split. Splits past the live context return at once."""
    if sms is None or programs >= sms:
        return 1
    by_len = _cdiv(max_seq_len, BLOCK_N)
    if by_len <= 1:
        return 1
    return _next_pow2(max(1, min(_cdiv(2 * sms, programs), by_len, MAX_SPLITS)))


def attention_launch(group: int, num_kv_heads: int, num_seqs: int, max_query_len: int,
                     max_seq_len: int, sms: int | None, num_splits: int | None = None
                     ) -> AttnLaunch:
    """The configuration of one call; ``num_splits`` forces the split count (tests)."""
    block_q = block_q_for(max_query_len, _next_pow2(group))
    q_blocks = _cdiv(max_query_len, block_q)
    if num_splits is None:
        num_splits = splits_for(num_seqs * q_blocks * num_kv_heads, max_seq_len, sms)
    kv_chunk = _cdiv(_cdiv(max_seq_len, num_splits), BLOCK_N) * BLOCK_N
    return AttnLaunch(block_q, num_splits, q_blocks, kv_chunk)


def merge_chunk_for(rows: int, dim_pad: int, num_splits: int, budget: int = 8192) -> int:
    """Splits merged per unrolled step by the fused merge: as many [rows, dim_pad] fp32 tiles
    as fit ``budget`` elements (64 registers a thread at 4 warps), so the loads of a step are
    issued together. All arguments are powers of two, and so is the result."""
    return max(1, min(num_splits, budget // (rows * dim_pad)))


def reachable_configs(group: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                      sms: int | None) -> list[tuple[int, int]]:
    """Every (block_q, num_splits) an engine can launch with query lengths 1..``max_query_len``
    and contexts up to ``max_seq_len`` (any batch size): block_q runs over the power-of-two
    classes of the query length; the split count is largest for the smallest grid (one
    sequence, one q block) and every power of two below it is reachable by a shorter context."""
    group_pad = _next_pow2(group)
    blocks = sorted({block_q_for(q, group_pad)
                     for q in [1 << i for i in range(max(1, max_query_len).bit_length() + 1)]
                     if q <= max(1, _next_pow2(max_query_len))})
    out = []
    for bq in blocks:
        top = splits_for(num_kv_heads, max_seq_len, sms)
        out += [(bq, s) for s in (1 << i for i in range(top.bit_length())) if s <= top]
    return out

