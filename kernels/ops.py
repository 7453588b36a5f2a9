"""The paged-KV attention and top-k ops (and, through ``kernels.gemm_ops``, the skinny-GEMM
ones), registered with torch.library so torch.compile traces them as opaque nodes (with fake
implementations for shape propagation) and our passes can find them."""
from __future__ import annotations

import torch

from kernels.attention_ref import (paged_attention_ref, paged_tree_attention_ref,
                                   rope_table_ref, rope_write_kv_ref, write_kv_ref)
from kernels.dispatch import attention_triton as _attention_triton
from kernels.dispatch import use_triton as _use_triton


@torch.library.custom_op("compiled_spec::write_kv", mutates_args=("k_cache", "v_cache"))
def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 rows are not written
) -> None:
    if _attention_triton(key):
        from kernels.attention_triton import write_kv_triton

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


@write_kv.register_fake
def _(key, value, k_cache, v_cache, slot_mapping) -> None:
    return None


@torch.library.custom_op("compiled_spec::rope_table", mutates_args=())
def rope_table(
    positions: torch.Tensor,  # [num_tokens] int
    cos_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    sin_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, head_dim] each, in dtype
    """A step's cos / sin rows, as an opaque op so that each is one buffer in the compiled
    graph. Gathered inline, they reached Inductor as an unrealized gather, and Inductor makes
    a copy of such an input for every op that takes it: each layer's rope op (rope_write_kv or
    qkv_rope_write_kv) got its own two copies (the CPU wrapper code: two [T, head_dim] buffers
    per layer; SmolLM2's decode call on the H200: 10 kernels gathering them, thirtieth
    session)."""
    if _use_triton(positions):
        from kernels.rope_kv_triton import rope_table_triton

        return rope_table_triton(positions, cos_cache, sin_cache, dtype)
    return rope_table_ref(positions, cos_cache, sin_cache, dtype)


@rope_table.register_fake
def _(positions, cos_cache, sin_cache, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (positions.shape[0], cos_cache.shape[1])
    return cos_cache.new_empty(shape, dtype=dtype), cos_cache.new_empty(shape, dtype=dtype)


@torch.library.custom_op("compiled_spec::rope_write_kv", mutates_args=("k_cache", "v_cache"))
def rope_write_kv(
    qk: torch.Tensor,  # [num_tokens, num_heads + num_kv_heads, head_dim], not yet roped
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 rows are not written
    cos: torch.Tensor,  # [num_tokens, head_dim]
    sin: torch.Tensor,  # [num_tokens, head_dim]
    num_heads: int,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] the roped queries
    """Rope of q and k and ``write_kv`` of (roped k, v) as one op: one kernel on the GPU
    (``kernels.rope_kv_triton``). k_cache, v_cache and slot_mapping sit where ``write_kv``
    has them, so the passes that bind a layer's metadata read both alike."""
    if _attention_triton(qk):
        from kernels.rope_kv_triton import rope_write_kv_triton

        return rope_write_kv_triton(qk, value, k_cache, v_cache, slot_mapping, cos, sin,
                                    num_heads)
    return rope_write_kv_ref(qk, value, k_cache, v_cache, slot_mapping, cos, sin, num_heads)


@rope_write_kv.register_fake
def _(qk, value, k_cache, v_cache, slot_mapping, cos, sin, num_heads) -> torch.Tensor:
    return qk.new_empty(qk.shape[0], num_heads, qk.shape[2])


@torch.library.custom_op("compiled_spec::paged_attention", mutates_args=())
def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if _attention_triton(query):
        from kernels.attention_triton import paged_attention_triton

        return paged_attention_triton(
            query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
            max_query_len, max_seq_len, scale,
        )
    return paged_attention_ref(
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        max_query_len, max_seq_len, scale,
    )


@paged_attention.register_fake
def _(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
      max_seq_len, scale) -> torch.Tensor:
    return torch.empty_like(query)


@torch.library.custom_op("compiled_spec::paged_tree_attention", mutates_args=())
def paged_tree_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    tree_start: torch.Tensor,  # [num_seqs] int32
    # [num_seqs] int32, tree_start + num_tree (where each sequence's keys end): given by the
    # caller, which has it in its metadata, rather than recomputed in every layer (an extra
    # kernel per layer inside the tree-verify graph)
    seq_lens: torch.Tensor,
    tree_mask: torch.Tensor,  # [num_tokens, num_tree] bool
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    num_tree: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if _attention_triton(query):
        from kernels.attention_triton import paged_tree_attention_triton

        return paged_tree_attention_triton(query, k_cache, v_cache, block_tables, tree_start,
                                           seq_lens, tree_mask, query_start_loc, max_query_len,
                                           max_seq_len, scale)
    return paged_tree_attention_ref(query, k_cache, v_cache, block_tables, tree_start, tree_mask,
                                    query_start_loc, max_query_len, num_tree, max_seq_len, scale,
                                    seq_lens=seq_lens)


@paged_tree_attention.register_fake
def _(query, k_cache, v_cache, block_tables, tree_start, seq_lens, tree_mask, query_start_loc,
      max_query_len, num_tree, max_seq_len, scale) -> torch.Tensor:
    return torch.empty_like(query)


_ROW_TOPK_CHECKED: set[tuple[int, int, torch.dtype, bool]] = set()  # shapes checked on this GPU


def row_topk_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of each row of ``x`` [R, N]: (values [R, k] float32, descending; indices
    [R, k] int64), ties to the smaller index (a stable descending sort)."""
    vals, idx = torch.sort(x.float(), dim=-1, descending=True, stable=True)
    # Row-major [R, k] as the fake says, also for one row: .contiguous() would keep the
    # sort's row stride N there (a size-1 dimension's stride does not count for contiguity),
    # and a compiled callable taking that output guards on it and compiles again at R > 1.
    return (vals[:, :k].clone(memory_format=torch.contiguous_format),
            idx[:, :k].clone(memory_format=torch.contiguous_format))


def row_topk_logprob_ref(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``row_topk_ref`` of log_softmax(x): the same indices (a row's shift keeps its order),
    the values less the row's logsumexp."""
    vals, idx = row_topk_ref(x, k)
    return vals - torch.logsumexp(x.float(), dim=-1, keepdim=True), idx


def _row_topk(x: torch.Tensor, k: int, logprob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    name = "row_topk_logprob" if logprob else "row_topk"
    if not 1 <= k <= x.shape[-1]:
        raise ValueError(f"{name}: k={k} outside [1, {x.shape[-1]}]")
    ref = row_topk_logprob_ref if logprob else row_topk_ref
    if not _use_triton(x):
        return ref(x, k)
    from kernels.topk_triton import row_topk_triton

    out = row_topk_triton(x, k, logprob=logprob)
    key = (x.shape[-1], k, x.dtype, logprob)
    # First use of a shape class (warm-up, never inside a capture): the kernel is checked
    # against the reference, as the KV-move kernel is; a wrong top-k would change drafts
    # silently (acceptance, never output), so it fails loudly here instead. Indices exactly;
    # log-probabilities to float32 rounding (the logsumexp sums in another order).
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    if key not in _ROW_TOPK_CHECKED and not capturing:
        want = ref(x, k)
        same = (torch.allclose(out[0], want[0], rtol=1e-5, atol=1e-4) if logprob
                else torch.equal(out[0], want[0]))
        if not (same and torch.equal(out[1], want[1])):
            raise RuntimeError(f"{name} Triton kernel disagrees with the reference for rows "
                               f"of {x.shape[-1]}, k={k}, {x.dtype}")
        _ROW_TOPK_CHECKED.add(key)
    return out


@torch.library.custom_op("compiled_spec::row_topk", mutates_args=())
def row_topk(x: torch.Tensor,  # [R, N] float, N >= k
             k: int) -> tuple[torch.Tensor, torch.Tensor]:  # [R, k] float32, [R, k] int64
    """Top-k along rows with a fixed tie rule (the smaller index first), so eager and compiled
    draft trees pick the same candidates; on CUDA a one- or two-launch Triton kernel
    (``kernels.topk_triton``) instead of torch.topk's multi-block radix select."""
    return _row_topk(x, k, logprob=False)


@row_topk.register_fake
def _(x, k) -> tuple[torch.Tensor, torch.Tensor]:
    r = x.shape[0]
    return (x.new_empty(r, k, dtype=torch.float32), x.new_empty(r, k, dtype=torch.int64))


@torch.library.custom_op("compiled_spec::row_topk_logprob", mutates_args=())
def row_topk_logprob(x: torch.Tensor,  # [R, N] logits, any float dtype, N >= k
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:  # [R, k] f32, [R, k] int64
    """``row_topk`` of log_softmax(x) without materializing it: the draft tree's children and
    their log-probabilities straight from the draft's logits, in the top-k's own launch."""
    return _row_topk(x, k, logprob=True)


@row_topk_logprob.register_fake
def _(x, k) -> tuple[torch.Tensor, torch.Tensor]:
    r = x.shape[0]
    return (x.new_empty(r, k, dtype=torch.float32), x.new_empty(r, k, dtype=torch.int64))


# The skinny-GEMM ops live in their own module; importing this one registers them too.
from kernels import gemm_ops  # noqa: E402,F401
