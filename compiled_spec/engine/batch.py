"""Host-side construction of flat token batches and their attention metadata.

Everything here is built from the engine's own Python state and moved to the device in one go;
nothing reads back from the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.kv_cache import BlockAllocator


@dataclass
class Span:
    """``length`` consecutive query tokens of one request starting at absolute ``start``.

    Positions at or beyond ``write_limit`` are inert: they write no KV (slot -1) and attend as if
    at ``write_limit - 1`` (whose KV exists), so padding rows never reach past the request's blocks.
    """

    req_id: int
    start: int
    length: int
    write_limit: int | None = None


def build_metadata(allocator: BlockAllocator, spans: list[Span],
                   device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
    """Returns positions [num_tokens] int64 and the metadata for the flat batch of ``spans``."""
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    for s in spans:
        limit = s.start + s.length if s.write_limit is None else s.write_limit
        for p in range(s.start, s.start + s.length):
            if p < limit:
                positions.append(p)
                slots.append(allocator.slot(s.req_id, p))
            else:
                positions.append(limit - 1)
                slots.append(-1)
        seq_lens.append(positions[-1] + 1 if s.length else s.start)
        qsl.append(qsl[-1] + s.length)
    tables = [allocator.tables[s.req_id] for s in spans]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(s.length for s in spans),
        max_seq_len=max(seq_lens),
    )
    pos = torch.tensor(positions, dtype=torch.int64)
    if device.type != "cpu":
        return pos.to(device, non_blocking=True), meta.to(device)
    return pos, meta


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.int64)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
