"""Paged KV cache: the block pool (tensors) and the allocator that hands blocks to requests."""
from __future__ import annotations

from collections import deque

import torch



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


class BlockAllocator:
    """Free list of physical KV blocks and the block table of each request.

    A request's table grows as its context grows (plus lookahead slots for speculative tokens)
    and shrinks when rejected tokens are rolled back; all its blocks return to the pool when it
    finishes or is preempted.
    """

    def __init__(self, num_blocks: int, page_size: int) -> None:
        self.num_blocks = num_blocks
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_grow(self, req_id: int, num_tokens: int) -> bool:
        have = len(self.tables.get(req_id, ()))
        return self.blocks_for(num_tokens) - have <= len(self._free)

    def grow(self, req_id: int, num_tokens: int) -> None:
        """Make the request's table cover ``num_tokens`` positions (all or nothing)."""
        table = self.tables.setdefault(req_id, [])
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            raise KVCacheExhausted(
                f"request {req_id} needs {need} more KV blocks for {num_tokens} tokens but only "
                f"{len(self._free)} of {self.num_blocks} are free")
        for _ in range(max(need, 0)):
            table.append(self._free.popleft())

    def shrink(self, req_id: int, num_tokens: int) -> None:
        """Return blocks beyond what ``num_tokens`` positions need (rolled-back lookahead)."""
        table = self.tables.get(req_id, [])
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, req_id: int) -> None:
        for b in self.tables.pop(req_id, []):
            self._free.append(b)

    def slot(self, req_id: int, position: int) -> int:
        table = self.tables[req_id]
        return table[position // self.page_size] * self.page_size + position % self.page_size
