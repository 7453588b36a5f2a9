"""Attention metadata passed explicitly to every model forward (no global forward context)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one flattened batch of query tokens over the paged KV cache.

    Sequence b owns query tokens ``query_start_loc[b]:query_start_loc[b+1]``; after this forward
    its context holds ``seq_lens[b]`` tokens, so its i-th query token sits at absolute position
    ``seq_lens[b] - q_len[b] + i`` and attends to context positions ``0..that position``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64; flat KV slot per token, -1 = do not write
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32; physical block ids
    seq_lens: torch.Tensor  # [num_seqs] int32; context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32; cumulative query lengths
    max_query_len: int  # host-side bound, sizes kernel grids without a device sync
    max_seq_len: int  # host-side bound on seq_lens
    # Tree attention (draft trees): queries see the prefix (positions < tree_start[b]) and the
    # tree slots tree_start[b] + j that their tree_mask row marks; None = causal attention.
    tree_start: torch.Tensor | None = None  # [num_seqs] int32
    tree_mask: torch.Tensor | None = None  # [num_tokens, num_tree] bool

    def first_query_positions(self) -> torch.Tensor:  # [num_seqs] int32
        """Each sequence's first query position, seq_lens - q_len, on the device: a tree's
        first slot (its root) whether it has N nodes or is a one-node request with one row
        (its keys and its block table end after that row). Padded sequences: 0 - 0."""
        return self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def to(self, device: torch.device | str) -> "AttentionMetadata":
        return AttentionMetadata(
            slot_mapping=self.slot_mapping.to(device, non_blocking=True),
            block_tables=self.block_tables.to(device, non_blocking=True),
            seq_lens=self.seq_lens.to(device, non_blocking=True),
            query_start_loc=self.query_start_loc.to(device, non_blocking=True),
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            tree_start=None if self.tree_start is None else self.tree_start.to(device, non_blocking=True),
            tree_mask=None if self.tree_mask is None else self.tree_mask.to(device, non_blocking=True),
        )
