"""Paged KV cache: the block pool (tensors) and the allocator that hands blocks to requests."""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Hashable

import torch

BlockKey = tuple[int, tuple[int, ...], int | None]  # (hash of the previous key, tokens, successor)


class KVCacheExhausted(RuntimeError):
    """Raised when the pool cannot supply the blocks a request needs right now."""


def bytes_per_block(page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block of one layer, keys and values."""
    return 2 * page_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def allocate_kv_pair(num_blocks: int, page_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (k, v), each [num_blocks, page_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, page_size, num_kv_heads, head_dim)
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device))


def extend_slots(out: list[int], table: list[int], page: int, start: int, end: int) -> None:
    """Append the KV slots of positions ``start`` .. ``end`` - 1 (``table``: a request's
    blocks): one range per page, not one lookup per position (a 32-node tree's slots took 32
    Python steps per request, every tree step)."""
    p = start
    while p < end:
        blk, off = divmod(p, page)
        n = min(end - p, page - off)
        first = table[blk] * page + off
        out.extend(range(first, first + n))
        p += n


class BlockAllocator:
    """Free list of physical KV blocks and the block table of each request.

    A request's table grows as its context grows (plus lookahead slots for speculative tokens)
    and shrinks when rejected tokens are rolled back; its blocks return to the pool when it
    finishes or is preempted.

    With ``prefix_caching``, full blocks can be registered under a content key (see
    ``compiled_spec.prefix_cache``) and shared: blocks carry reference counts, a block whose
    count drops to 0 keeps its content in an LRU of cached blocks, and allocation takes free
    blocks first, then evicts the least recently used cached block. Shared blocks are full and
    lie before every owner's first uncomputed position, so nothing ever writes into them.
    """

    def __init__(self, num_blocks: int, page_size: int, prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self._refs = [0] * num_blocks
        self._block_of: dict[Hashable, int] = {}  # key hash -> block
        self._key_of: dict[int, tuple[Hashable, BlockKey]] = {}  # block -> (hash, key)
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks with no reference
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks a request could get now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, req_id: int, num_tokens: int) -> bool:
        have = len(self.tables.get(req_id, ()))
        return self.blocks_for(num_tokens) - have <= self.num_free

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:  # evict the least recently used cached block
            b, _ = self._lru.popitem(last=False)
            h, _ = self._key_of.pop(b)
            del self._block_of[h]
            self.num_evictions += 1
        self._refs[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._refs[b] -= 1
        if self._refs[b] == 0:
            if b in self._key_of:
                self._lru[b] = None  # keeps its content until evicted
            else:
                self._free.append(b)

    def grow(self, req_id: int, num_tokens: int) -> None:
        """Make the request's table cover ``num_tokens`` positions (all or nothing)."""
        table = self.tables.setdefault(req_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free:
            raise KVCacheExhausted(
                f"request {req_id} needs {need} more KV blocks for {num_tokens} tokens but only "
                f"{self.num_free} of {self.num_blocks} are free")
        for _ in range(max(need, 0)):
            table.append(self._take())

    def grow_all(self, wants: list[tuple[int, int]]) -> bool:
        """``grow`` for every (req_id, num_tokens), or none of them and False when the pool
        cannot cover them all (an early step's worst case: it must not half-grow a batch)."""
        page, tables = self.page_size, self.tables
        short = [(rid, n) for rid, n in wants if -(-n // page) > len(tables.get(rid, ()))]
        if not short:  # the common case of a step: every table already covers its request
            return True
        if sum(-(-n // page) - len(tables.get(rid, ())) for rid, n in short) > self.num_free:
            return False
        for rid, n in short:
            self.grow(rid, n)
        return True

    def shrink(self, req_id: int, num_tokens: int) -> None:
        """Return blocks beyond what ``num_tokens`` positions need (rolled-back lookahead)."""
        table = self.tables.get(req_id, [])
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, req_id: int) -> None:
        for b in self.tables.pop(req_id, []):
            self._release(b)

    def slot(self, req_id: int, position: int) -> int:
        table = self.tables[req_id]
        return table[position // self.page_size] * self.page_size + position % self.page_size

    # ---- prefix caching ------------------------------------------------------------------------
    def match(self, req_id: int, keys: list[tuple[Hashable, BlockKey]]) -> int:
        """Put the cached blocks of the longest matching prefix of ``keys`` (hash, key) at the
        start of the request's (empty) table; returns how many blocks matched. The full key is
        compared, so a hash collision can never hand out another prefix's KV."""
        table = self.tables.setdefault(req_id, [])
        if table:
            raise RuntimeError(f"request {req_id}: match() needs an empty block table")
        for h, key in keys:
            b = self._block_of.get(h)
            if b is None or self._key_of[b][1] != key:
                break
            self._lru.pop(b, None)  # in the LRU only while unreferenced
            self._refs[b] += 1
            table.append(b)
        return len(table)

    def register(self, req_id: int, index: int, h: Hashable, key: BlockKey) -> None:
        """Record that block ``index`` of the request holds the KV of ``key`` (complete)."""
        b = self.tables[req_id][index]
        if h in self._block_of or b in self._key_of:
            return  # the same content is cached elsewhere, or this block already is
        self._block_of[h] = b
        self._key_of[b] = (h, key)
