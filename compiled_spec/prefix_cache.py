"""Content keys of full KV blocks, for prefix caching.

Block i of a token sequence is keyed by (hash of block i-1's key, its page_size tokens,
successor), chained so a key identifies the whole prefix. The target's KV of a block depends only
on the tokens up to its end, but an EAGLE draft's KV at position p is computed from (token p+1,
target state p): the block's last draft entry depends on the first token of the next block. So
speculative engines key a block with that successor token (mode "successor"): a cached block is
reused only where the next token matches too, and then nothing needs recomputing. Mode
"recompute" (vLLM's way) keys blocks by their own tokens and, in a speculative engine, never
reuses the last matched block, whose last draft entry may be stale.
"""
from __future__ import annotations

from typing import Hashable

from compiled_spec.kv_cache import BlockKey

MODES = ("successor", "recompute")


def block_keys(tokens: list[int], page_size: int, num_blocks: int, with_successor: bool,
               start: int = 0, prev: Hashable = None) -> list[tuple[Hashable, BlockKey]]:
    """(hash, key) of blocks start .. num_blocks-1; ``prev`` is block start-1's hash. Every
    keyed block must be full and, with successors, followed by at least one token."""
    out = []
    for i in range(start, num_blocks):
        lo, hi = i * page_size, (i + 1) * page_size
        succ = tokens[hi] if with_successor else None
        key: BlockKey = (prev, tuple(tokens[lo:hi]), succ)  # type: ignore[assignment]
        prev = hash(key)
        out.append((prev, key))
    return out


def matchable_blocks(num_tokens: int, page_size: int) -> int:
    """Full blocks that may come from the cache: at least one token must be left to compute
    (its logits give the next token), which also leaves each matched block a successor."""
    return max(0, (num_tokens - 1) // page_size)
