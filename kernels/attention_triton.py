"""Triton implementations of the paged-KV ops; same semantics as ``kernels.attention_ref``.

Attention is flash-attention style (online softmax in fp32). One program owns one sequence, one
block of its query tokens and one KV head, and processes every query head of that KV head's GQA
group at once: the rows of its score tile are (token, head-in-group) pairs, so each K/V tile is
loaded once per group instead of once per query head and repeated K/V are never materialised.
When the batch has too few programs to fill the GPU (small-batch decode / verification), the KV
range is additionally split across programs (flash-decoding) and the partial results are merged
by a separate merge kernel, or (``COMPILED_SPEC_FUSED_MERGE=1``) by the split that finishes
last, found with a per-tile atomic counter: one kernel per attention instead of two. The fused
form is off by default: its first version, a loop with one split per iteration, measured
slower on the H200 (14.6 us per call against 4.2 + 2.0); the merge now loads the splits in
unrolled chunks, not yet timed on the GPU. Every loop bound comes from device tensors or host
ints: no host syncs.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from kernels.attention_merge_triton import (COUNTER_SLOTS, FUSED_MERGE, _merge_splits_kernel,
                                            last_to_arrive, reset_counter, split_counters)
from kernels.dispatch import pdl_launch
from kernels.launch import BLOCK_N, attention_launch, merge_chunk_for
from kernels.write_kv_triton import write_kv_triton  # noqa: F401  (re-exported)


# Per-call integers kept off the specialisation key (kernels.launch): a new value class would
# otherwise compile a new binary mid-serving. All are scalar offsets (no vectorised access).
# So are the metadata pointers' 16-byte alignment (see kernels/launch.py).
@triton.jit(do_not_specialize=["stride_bt", "stride_ls", "kv_chunk", "num_seqs", "num_tokens",
                               "table_keys"],
            do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr",
                                            "query_start_loc_ptr", "tree_start_ptr",
                                            "tree_mask_ptr"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_ptr, lse_ptr, counter_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, num_seqs, num_tokens,
    tree_start_ptr, tree_mask_ptr, stride_mt, num_tree,  # tree attention (TREE) only
    stride_qt, stride_qh,  # query may be a strided view (q and k roped as one tensor)
    stride_ot, stride_oh,  # out is allocated contiguous
    stride_cb, stride_cp, stride_ch,  # k_cache and v_cache share strides
    stride_bt, table_keys,  # table_keys: keys the block table's rows can address
    stride_ps, stride_pt, stride_ph,  # partial out [splits, tokens, heads, dim] (split path only)
    stride_ls, stride_lt,  # partial lse [splits, tokens, heads] (split path only)
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2 (exp2 is the fast path)
    head_dim, page_size, kv_chunk,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr, TREE: tl.constexpr, FUSED_MERGE: tl.constexpr,
    MERGE_CHUNK: tl.constexpr, GDC: tl.constexpr,
):
    if GDC:  # launched with PDL (kernels.dispatch): wait for the kernel ahead, free the next
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    seq = tl.program_id(0)
    q_block = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    kv_head = tl.program_id(2)
    # Rows are (token, head-in-group) pairs; GROUP_PAD rounds the group to a power of two.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)  # [M]
    in_group = rows % GROUP_PAD < GROUP
    head = kv_head * GROUP + rows % GROUP_PAD  # [M] query head
    d = tl.arange(0, DIM_PAD)  # [D]
    d_ok = d < head_dim

    # Tokens past the last sequence's (the padding rows of a captured batch) belong to no
    # program; the first program of each KV head zeroes them for its heads, as the reference
    # does, so `out` needs no fill kernel. (The unfused split path's merge kernel does it there.)
    if (NUM_SPLITS == 1 or FUSED_MERGE) and tl.program_id(0) == 0 and tl.program_id(1) == 0:
        for t0 in range(tl.load(query_start_loc_ptr + num_seqs), num_tokens, BLOCK_Q):
            z_tok = (t0 + rows // GROUP_PAD).to(tl.int64)  # [M]
            z_ok = (z_tok < num_tokens) & in_group
            tl.store(out_ptr + z_tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                     tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], out_ptr.dtype.element_ty),
                     mask=z_ok[:, None] & d_ok[None, :])

    # The first key tile's block-table entries: this split's first key ``lo`` is known
    # without the sequence's length, so the load goes out beside the metadata's instead of
    # after it, and the tile's K / V loads wait on one round trip to memory, not two. Entries
    # past the sequence are read but never used (the K / V loads are masked by position).
    lo = split * kv_chunk
    bt_row = block_tables_ptr + seq * stride_bt
    first = lo + tl.arange(0, BLOCK_N)  # [N]
    blk = tl.load(bt_row + first // page_size, mask=first < table_keys, other=0)  # [N]
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:  # covers q_len 0 (padding sequences) and short sequences
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # absolute position of this sequence's first query token
    tok = q_block * BLOCK_Q + rows // GROUP_PAD  # [M] token index within the sequence
    row_ok = (tok < q_len) & in_group
    q_pos = ctx_len + tok  # [M] absolute position of each row's token
    t64 = (q_start + tok).to(tl.int64)
    q_off = t64[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    if DOT_FP32:  # K/V follow q's dtype below, so both matmuls then run in fp32
        q = q.to(tl.float32)

    # Keys this query block may see end at its last token's position (causality), capped at the
    # context length; a KV split covers one kv_chunk-sized slice of that range (the last split
    # runs to the end, so a seq_len above the max_seq_len bound is still covered).
    if TREE:  # tree queries see the prefix and marked tree slots: no causal cut-off
        tstart = tl.load(tree_start_ptr + seq)
        kv_end = seq_len
    else:
        kv_end = tl.minimum(seq_len, ctx_len + (q_block + 1) * BLOCK_Q)
    hi = kv_end
    if split < NUM_SPLITS - 1:
        hi = tl.minimum(kv_end, lo + kv_chunk)

    # m starts finite so fully masked rows give exp2(-inf - m) = 0 instead of NaN.
    m_i = tl.full([BLOCK_Q * GROUP_PAD], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [N] absolute key positions
        pos_ok = pos < hi
        # Physical slot through the block table (blk: this tile's entries, loaded one tile
        # ahead), per position, so any page_size works.
        kv_off = (blk.to(tl.int64) * stride_cb + (pos % page_size) * stride_cp
                  + kv_head * stride_ch)[:, None] + d[None, :]  # [N, D]
        kv_mask = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # [N, D]
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # [N, D]
        nxt = pos + BLOCK_N  # the next tile's entries, in flight during this tile's math
        blk = tl.load(bt_row + nxt // page_size, mask=nxt < hi, other=0)
        if DOT_FP32:  # exact fp32 products, not the GPU's default TF32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # [M, N]
        if TREE:
            rel = pos - tstart  # [N] tree slot of each key (negative: the prefix)
            in_tree = (rel >= 0) & (rel < num_tree) & pos_ok
            bit = tl.load(tree_mask_ptr + (q_start + tok).to(tl.int64)[:, None] * stride_mt
                          + rel[None, :], mask=row_ok[:, None] & in_tree[None, :], other=0)
            allowed = ((pos[None, :] < tstart) | (bit != 0)) & pos_ok[None, :]
        else:
            allowed = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [M, N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_FP32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # Rows with no visible key (padding rows, or an empty split) keep l = 0: emit zeros.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    store_mask = row_ok[:, None] & d_ok[None, :]
    o_off = t64[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]  # [M, D]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        p_row = t64[:, None] * stride_pt + head[:, None] * stride_ph + d[None, :]  # [M, D]
        tl.store(part_ptr + split * stride_ps + p_row, out, mask=store_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # base-2 log-sum-exp
        l_row = t64 * stride_lt + head  # [M]
        tl.store(lse_ptr + split * stride_ls + l_row, lse, mask=row_ok)
        if FUSED_MERGE:  # the tile's last split to finish merges (last_to_arrive)
            tile = (seq * (tl.num_programs(1) // NUM_SPLITS) + q_block) * tl.num_programs(2) \
                + kv_head
            if last_to_arrive(counter_ptr + tile, NUM_SPLITS):
                # Every split's lse of the tile in one load, and the parts in chunks of
                # MERGE_CHUNK splits unrolled: loads through L2 that do not wait for each
                # other. (A loop of one split per iteration waited ~0.4 us per split on the
                # H200: 14.6 us per call against 4.2 + 2.0 for the separate merge kernel.)
                sp = tl.arange(0, NUM_SPLITS)  # [S]
                lse_all = tl.load(lse_ptr + sp[:, None] * stride_ls + l_row[None, :],
                                  mask=row_ok[None, :], other=float("-inf"),
                                  cache_modifier=".cg")  # [S, M]
                m_all = tl.max(lse_all, 0)  # [M]
                m_all = tl.where(m_all > float("-inf"), m_all, 0.0)
                w_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
                merged = tl.zeros([BLOCK_Q * GROUP_PAD, DIM_PAD], tl.float32)
                for c in tl.static_range(0, NUM_SPLITS, MERGE_CHUNK):  # fixed order
                    sc = c + tl.arange(0, MERGE_CHUNK)  # [C]
                    lse_c = tl.load(lse_ptr + sc[:, None] * stride_ls + l_row[None, :],
                                    mask=row_ok[None, :], other=float("-inf"),
                                    cache_modifier=".cg")  # [C, M]
                    w_c = tl.where(lse_c > float("-inf"), tl.exp2(lse_c - m_all[None, :]), 0.0)
                    part = tl.load(part_ptr + sc[:, None, None] * stride_ps + p_row[None, :, :],
                                   mask=store_mask[None, :, :] & (w_c > 0.0)[:, :, None],
                                   other=0.0, cache_modifier=".cg")  # [C, M, D]
                    merged += tl.sum(part * w_c[:, :, None], 0)
                    w_sum += tl.sum(w_c, 0)
                merged = merged / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
                tl.store(out_ptr + o_off, merged.to(out_ptr.dtype.element_ty), mask=store_mask)
                reset_counter(counter_ptr + tile)


def _dot_in_fp32(dtype: torch.dtype) -> bool:
    # fp32 inputs stay fp32. The CPU interpreter (TRITON_INTERPRET=1, used by the tests) runs
    # tl.dot on bf16 operands as matmuls of their raw uint16 bits, so there bf16 tiles are upcast
    # (exactly) first; on the GPU bf16/fp16 go to the tensor cores as they are.
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(t: torch.Tensor) -> int | None:
    """Streaming multiprocessors of ``t``'s GPU; None off CUDA (no KV split)."""
    if not t.is_cuda:
        return None
    return _num_sms(t.device.index if t.device.index is not None else 0)


def _paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_splits: int | None,  # None = heuristic; must be a power of two otherwise
    tree_start: torch.Tensor | None = None,  # [num_seqs] int32: tree attention when given
    tree_mask: torch.Tensor | None = None,  # [num_tokens, num_tree] bool
    fused_merge: bool | None = None,  # None = FUSED_MERGE (tests force either)
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]; every row is written
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0 or max_seq_len == 0:
        return query.new_zeros(query.shape)
    assert query.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()

    group_pad = triton.next_power_of_2(group)
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    cfg = attention_launch(group, num_kv_heads, num_seqs, max_query_len, max_seq_len,
                           num_sms(query), num_splits)
    block_q, block_n, q_blocks = cfg.block_q, BLOCK_N, cfg.q_blocks
    num_splits, kv_chunk = cfg.num_splits, cfg.kv_chunk
    grid = (num_seqs, q_blocks * num_splits, num_kv_heads)
    fused = (FUSED_MERGE if fused_merge is None else fused_merge) and num_splits > 1 \
        and num_seqs * q_blocks * num_kv_heads <= COUNTER_SLOTS

    if out is None:  # uninitialised: the kernel writes every row, unowned ones with zeros
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    part, lse, counters = out, out, out  # placeholders where unused
    if num_splits > 1:
        part = torch.empty((num_splits, num_tokens, num_heads, head_dim), dtype=torch.float32,
                           device=query.device)  # [splits, num_tokens, num_heads, head_dim]
        lse = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32,
                          device=query.device)  # [splits, num_tokens, num_heads]
    if fused:
        counters = split_counters(query.device)
    tree = tree_mask is not None
    if tree:  # uint8 bits; keys run to the end of each sequence's tree (seq_lens)
        mask_u8 = tree_mask.contiguous().view(torch.uint8)
        num_tree = tree_mask.shape[1]
    _paged_attn_kernel[grid](
        query, k_cache, v_cache, out, part, lse, counters,
        block_tables, seq_lens, query_start_loc, num_seqs, num_tokens,
        tree_start if tree else seq_lens, mask_u8 if tree else seq_lens,
        mask_u8.stride(0) if tree else 0, num_tree if tree else 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), block_tables.shape[1] * page_size,
        part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
        scale * 1.4426950408889634,  # log2(e)
        head_dim, page_size, kv_chunk,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n, DIM_PAD=dim_pad,
        NUM_SPLITS=num_splits, DOT_FP32=_dot_in_fp32(query.dtype), TREE=tree, FUSED_MERGE=fused,
        MERGE_CHUNK=merge_chunk_for(block_q * group_pad, dim_pad, num_splits),
        **pdl_launch(query, attention=True),
    )
    if num_splits > 1 and not fused:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part, lse, out, query_start_loc, num_seqs,
            part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1), head_dim,
            NUM_SPLITS=num_splits, DIM_PAD=dim_pad, **pdl_launch(query, attention=True),
        )
    return out


def paged_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    return _paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            max_query_len, max_seq_len, scale, num_splits=None)


def paged_tree_attention_triton(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    tree_start: torch.Tensor,  # [num_seqs] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32: tree_start + num_tree
    tree_mask: torch.Tensor,  # [num_tokens, num_tree] bool
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    max_seq_len: int,  # bound on tree_start + num_tree
    scale: float,
) -> torch.Tensor:
    return _paged_attention(query, k_cache, v_cache, block_tables, seq_lens,
                            query_start_loc, max_query_len, max_seq_len, scale, num_splits=None,
                            tree_start=tree_start, tree_mask=tree_mask)
