"""Turns a scheduled batch into tensors, runs the target model and samples on device."""
from __future__ import annotations

import torch

from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.engine.request import Request
from compiled_spec.kv_cache import BlockAllocator
from compiled_spec.models.decoder import CausalLM
from compiled_spec.sampler import SamplingTensors, sample


def build_metadata(
    allocator: BlockAllocator,
    reqs: list[Request],
    num_new: list[int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Host-side bookkeeping for one forward: flat input ids, positions and attention metadata.

    Built from Python lists (the engine's own state), then moved in one go; nothing here reads
    back from the device.
    """
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    tables = [allocator.tables[r.req_id] for r in reqs]
    for r, n in zip(reqs, num_new):
        start = r.num_computed
        toks = r.token_ids
        ids.extend(toks[start:start + n])
        positions.extend(range(start, start + n))
        slots.extend(allocator.slot(r.req_id, p) for p in range(start, start + n))
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(padded, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(num_new),
        max_seq_len=max(seq_lens),
    )
    input_ids = torch.tensor(ids, dtype=torch.int64)  # [num_tokens]
    pos = torch.tensor(positions, dtype=torch.int64)  # [num_tokens]
    if device.type != "cpu":
        return input_ids.to(device, non_blocking=True), pos.to(device, non_blocking=True), meta.to(device)
    return input_ids, pos, meta


def build_sampling_tensors(reqs: list[Request], device: torch.device) -> SamplingTensors:
    ps = [r.params for r in reqs]
    return SamplingTensors(
        temperature=torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=device),
        top_k=torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=device),
        top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=device),
        min_p=torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=device),
        seeds=torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=device),
        all_greedy=all(p.greedy for p in ps),
        any_sorting=any(p.needs_sorting for p in ps),
        any_min_p=any(p.min_p > 0 and not p.greedy for p in ps),
    )


class ModelRunner:
    def __init__(self, model: CausalLM, allocator: BlockAllocator, device: torch.device) -> None:
        self.model = model
        self.allocator = allocator
        self.device = device

    @torch.inference_mode()
    def step(self, reqs: list[Request], num_new: list[int]) -> list[int]:
        """One forward over the scheduled tokens; returns the sampled next token per request."""
        input_ids, positions, meta = build_metadata(self.allocator, reqs, num_new, self.device)
        hidden, _ = self.model(input_ids, positions, meta)  # [num_tokens, hidden]
        last = meta.query_start_loc[1:].to(torch.int64) - 1  # [num_seqs]
        logits = self.model.compute_logits(hidden[last])  # [num_seqs, vocab]
        st = build_sampling_tensors(reqs, self.device)
        next_pos = torch.tensor([r.num_computed + n for r, n in zip(reqs, num_new)],
                                dtype=torch.int64, device=self.device)
        tokens = sample(logits, st, next_pos)  # [num_seqs]
        return tokens.tolist()  # the step's single device-to-host copy
