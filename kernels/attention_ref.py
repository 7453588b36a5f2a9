"""PyTorch reference implementations of the paged-KV ops (exact on the CPU, used for testing)."""
from __future__ import annotations

import torch


def write_kv_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    num_blocks, page_size = k_cache.shape[:2]
    k_flat = k_cache.view(num_blocks * page_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * page_size, *v_cache.shape[2:])
    # Padding rows carry slot -1 and must leave the cache untouched. Boolean indexing syncs, which
    # is free on the CPU this reference serves; the GPU kernel skips them without a sync.
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].to(torch.int64)
    k_flat.index_copy_(0, slots, key[valid].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[valid].to(v_cache.dtype))


def rope_table_ref(
    positions: torch.Tensor,  # [num_tokens] int
    cos_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    sin_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # [num_tokens, head_dim] each, in dtype
    """The rope tables' rows at ``positions``, gathered in fp32 and cast to ``dtype`` (as HF
    Llama computes them)."""
    return cos_cache[positions].to(dtype), sin_cache[positions].to(dtype)


def rope_write_kv_ref(
    qk: torch.Tensor,  # [num_tokens, num_heads + num_kv_heads, head_dim], not yet roped
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
    cos: torch.Tensor,  # [num_tokens, head_dim]
    sin: torch.Tensor,  # [num_tokens, head_dim]
    num_heads: int,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Neox rope of the queries and keys (the model's ``apply_rope``, in the inputs' dtype),
    the roped keys and the values into the cache (``write_kv_ref``); returns the roped queries."""
    half = qk.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    roped = qk * c + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * s
    write_kv_ref(roped[:, num_heads:], value, k_cache, v_cache, slot_mapping)
    return roped[:, :num_heads].contiguous()


def check_tables_cover(block_tables: torch.Tensor, seq_lens: torch.Tensor, page_size: int) -> None:
    """Each sequence's block table must hold ceil(seq_len / page_size) entries. The Triton
    kernel reads entry pos // page_size unchecked (past the table: an illegal address on a
    GPU), while the gathers here clamp, so a short table would pass the CPU tests silently."""
    need = (seq_lens.to(torch.int64) + page_size - 1) // page_size  # [num_seqs]
    if bool((need > block_tables.shape[1]).any()):
        raise ValueError(f"block tables of {block_tables.shape[1]} entries (page_size "
                         f"{page_size}) do not cover seq_lens {seq_lens.tolist()}")


def paged_attention_ref(
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
    """Causal attention of each sequence's new query tokens over its paged context, in fp32."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = query.new_zeros(query.shape)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0 or max_seq_len == 0:
        return out
    device = query.device
    check_tables_cover(block_tables, seq_lens, page_size)
    seq_lens = seq_lens.to(torch.int64)
    starts = query_start_loc[:-1].to(torch.int64)
    q_lens = query_start_loc[1:].to(torch.int64) - starts  # [num_seqs]

    # Gather each sequence's context through its block table.
    kv_pos = torch.arange(max_seq_len, device=device)  # [max_seq_len]
    max_blocks = block_tables.shape[1]
    blk_idx = (kv_pos // page_size).clamp(max=max_blocks - 1)
    blocks = block_tables.to(torch.int64)[:, blk_idx].clamp(min=0)  # [num_seqs, max_seq_len]
    slots = blocks * page_size + kv_pos % page_size
    k_flat = k_cache.reshape(-1, num_kv_heads, head_dim)
    v_flat = v_cache.reshape(-1, num_kv_heads, head_dim)
    keys = k_flat[slots].float()  # [num_seqs, max_seq_len, num_kv_heads, head_dim]
    values = v_flat[slots].float()

    # Scatter the flat query tokens into a padded [num_seqs, max_query_len] layout.
    q_idx = torch.arange(max_query_len, device=device)  # [max_query_len]
    q_valid = q_idx[None, :] < q_lens[:, None]  # [num_seqs, max_query_len]
    tok = (starts[:, None] + q_idx[None, :]).clamp(max=num_tokens - 1)
    q = query[tok].float()  # [num_seqs, max_query_len, num_heads, head_dim]
    q_pos = seq_lens[:, None] - q_lens[:, None] + q_idx[None, :]  # [num_seqs, max_query_len]

    allowed = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (
        kv_pos[None, None, :] < seq_lens[:, None, None]
    )  # [num_seqs, max_query_len, max_seq_len]
    allowed = allowed & q_valid[:, :, None]

    # GQA without repeating K/V: query heads are grouped per kv head.
    q = q.view(num_seqs, max_query_len, num_kv_heads, group, head_dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", q, keys) * scale
    mask = allowed[:, None, None]  # [num_seqs, 1, 1, max_query_len, max_seq_len]
    scores = scores.masked_fill(~mask, float("-inf"))
    # Rows with nothing allowed (padding) would be all -inf; keep them finite and zero them below.
    scores = torch.where(mask.any(-1, keepdim=True), scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1)
    ctx = torch.einsum("bhgqk,bkhd->bqhgd", probs, values).reshape(
        num_seqs, max_query_len, num_heads, head_dim)
    ctx = ctx * q_valid[:, :, None, None]
    flat_tok = torch.where(q_valid, tok, torch.full_like(tok, num_tokens))
    out_ext = torch.zeros((num_tokens + 1, num_heads, head_dim), device=device, dtype=torch.float32)
    out_ext.index_copy_(0, flat_tok.reshape(-1), ctx.reshape(-1, num_heads, head_dim))
    # Several padded slots map to the scratch row num_tokens; index_copy with duplicates there is
    # harmless because that row is dropped.
    return out_ext[:num_tokens].to(query.dtype)


def paged_tree_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: tree nodes, grouped per sequence
    k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    tree_start: torch.Tensor,  # [num_seqs] int32: first tree position = prefix length
    tree_mask: torch.Tensor,  # [num_tokens, num_tree] bool: query -> tree slot visible
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    max_query_len: int,
    num_tree: int,  # tree slots per sequence: positions tree_start .. tree_start + num_tree - 1
    max_seq_len: int,  # bound on tree_start + num_tree
    scale: float,
    seq_lens: torch.Tensor | None = None,  # [num_seqs] where each sequence's keys end
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Tree attention over a paged cache: every query of sequence b sees the whole prefix
    (positions < tree_start[b]) and the tree slots its row of ``tree_mask`` marks (its ancestors
    and itself), whose keys/values were written at positions tree_start[b] + j. fp32.
    ``seq_lens`` (default tree_start + num_tree): a sequence with fewer tree slots (a one-node
    request in a step mixing trees and plain decodes) ends its keys, and its table, there."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = tree_start.shape[0]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = query.new_zeros(query.shape)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    device = query.device
    start = tree_start.to(torch.int64)
    ends = start + num_tree if seq_lens is None else seq_lens.to(torch.int64)  # [num_seqs]
    check_tables_cover(block_tables, ends, page_size)
    starts = query_start_loc[:-1].to(torch.int64)
    q_lens = query_start_loc[1:].to(torch.int64) - starts
    kv_pos = torch.arange(max_seq_len, device=device)
    blk_idx = (kv_pos // page_size).clamp(max=block_tables.shape[1] - 1)
    # Entries past a sequence's keys are never seen (masked below) and may hold anything.
    blocks = block_tables.to(torch.int64)[:, blk_idx].clamp(0, k_cache.shape[0] - 1)
    slots = blocks * page_size + kv_pos % page_size  # [num_seqs, max_seq_len]
    keys = k_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
    values = v_cache.reshape(-1, num_kv_heads, head_dim)[slots].float()
    q_idx = torch.arange(max_query_len, device=device)
    q_valid = q_idx[None, :] < q_lens[:, None]  # [num_seqs, max_query_len]
    tok = (starts[:, None] + q_idx[None, :]).clamp(max=num_tokens - 1)
    q = query[tok].float()  # [num_seqs, max_query_len, num_heads, head_dim]
    rel = kv_pos[None, :] - start[:, None]  # [num_seqs, max_seq_len] position in the tree
    in_tree = (rel >= 0) & (rel < num_tree) & (kv_pos[None, :] < ends[:, None])
    tm = tree_mask[tok]  # [num_seqs, max_query_len, num_tree]
    tree_ok = torch.gather(tm, 2, rel.clamp(0, num_tree - 1)[:, None, :].expand(
        -1, max_query_len, -1))  # [num_seqs, max_query_len, max_seq_len]
    allowed = ((rel < 0)[:, None, :] | (in_tree[:, None, :] & tree_ok)) & q_valid[:, :, None]
    q = q.view(num_seqs, max_query_len, num_kv_heads, group, head_dim)
    scores = torch.einsum("bqhgd,bkhd->bhgqk", q, keys) * scale
    mask = allowed[:, None, None]
    scores = scores.masked_fill(~mask, float("-inf"))
    scores = torch.where(mask.any(-1, keepdim=True), scores, torch.zeros_like(scores))
    probs = torch.softmax(scores, dim=-1)
    ctx = torch.einsum("bhgqk,bkhd->bqhgd", probs, values).reshape(
        num_seqs, max_query_len, num_heads, head_dim) * q_valid[:, :, None, None]
    flat_tok = torch.where(q_valid, tok, torch.full_like(tok, num_tokens))
    out_ext = torch.zeros((num_tokens + 1, num_heads, head_dim), device=device, dtype=torch.float32)
    out_ext.index_copy_(0, flat_tok.reshape(-1), ctx.reshape(-1, num_heads, head_dim))
    return out_ext[:num_tokens].to(query.dtype)
