"""Self-distillation data for EAGLE-3 training.

The target answers the training prompts itself (through our engine), so the draft learns the
distribution it will be verified against, not some other model's. A training sequence is
prompt + response token ids with a loss mask over the response. The target's aux hidden states and
logits are not stored: ``TargetFeaturizer`` recomputes them per batch (one no-grad target forward),
which costs less than the draft's own training step on large targets and saves [S, 3h + V] floats
per token of disk.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from compiled_spec.engine.batch import Span, build_metadata
from compiled_spec.kv_cache import BlockAllocator, allocate_kv_pair
from compiled_spec.models.decoder import CausalLM

if TYPE_CHECKING:
    from compiled_spec.llm import LLM


@dataclass
class PromptRow:
    id: str
    text: str | None  # chat-templated with the target's template
    ids: list[int] | None  # used verbatim (``prompt_ids`` rows: no template)


@dataclass
class TrainSequence:
    id: str
    input_ids: list[int]  # prompt + response, target vocab
    num_prompt: int  # loss covers input_ids[num_prompt:]


def load_prompts(path: str | Path, num_prompts: int | None = None) -> list[PromptRow]:
    """JSONL rows ``{"id", "prompt"}`` (text) or ``{"id", "prompt_ids"}`` (token ids)."""
    p = Path(path)
    if "mt_bench" in str(p).lower().replace("-", "_"):
        raise ValueError(f"{path}: MT-bench is the evaluation set; never train on it")
    if not p.is_file():
        raise FileNotFoundError(f"prompts file does not exist: {path}")
    rows: list[PromptRow] = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: malformed JSON: {e}") from None
        rid = str(r.get("id", n))
        if isinstance(r.get("prompt_ids"), list):
            ids = r["prompt_ids"]
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{path}:{n}: prompt_ids must be a non-empty list of ints")
            rows.append(PromptRow(rid, None, list(ids)))
        elif isinstance(r.get("prompt"), str) and r["prompt"]:
            rows.append(PromptRow(rid, r["prompt"], None))
        else:
            raise ValueError(f"{path}:{n}: expected a non-empty 'prompt' string or 'prompt_ids'")
        if num_prompts is not None and len(rows) >= num_prompts:
            break
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def generate_sequences(llm: "LLM", prompts: list[PromptRow], max_new_tokens: int,
                       max_seq_len: int, temperature: float = 0.0, batch_size: int = 32,
                       seed: int = 0, ignore_eos: bool = False) -> list[TrainSequence]:
    """Let the target answer every prompt with our engine; prompts too long to leave room for
    at least two response tokens within ``max_seq_len`` are skipped."""
    from compiled_spec.sampling_params import SamplingParams

    encoded: list[tuple[PromptRow, list[int]]] = []
    for row in prompts:
        ids = row.ids if row.ids is not None else llm.encode_chat(
            [{"role": "user", "content": row.text}])
        if len(ids) <= max_seq_len - 2:
            encoded.append((row, ids))
    out: list[TrainSequence] = []
    bar = tqdm(total=len(encoded), desc="self-distill", unit="prompt")
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start:start + batch_size]
        params = [SamplingParams(max_tokens=min(max_new_tokens, max_seq_len - len(ids)),
                                 temperature=temperature, seed=seed * 1_000_003 + start + i,
                                 ignore_eos=ignore_eos)
                  for i, (_, ids) in enumerate(chunk)]
        for (row, ids), res in zip(chunk, llm.generate([ids for _, ids in chunk], params)):
            resp = res.outputs[0].token_ids
            if resp:
                out.append(TrainSequence(row.id, list(ids) + list(resp), len(ids)))
        bar.update(len(chunk))
    bar.close()
    if not out:
        raise ValueError("the target produced no usable training sequences")
    return out


def save_sequences(path: Path, seqs: list[TrainSequence]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for s in seqs:
            f.write(json.dumps({"id": s.id, "input_ids": s.input_ids,
                                "num_prompt": s.num_prompt}) + "\n")
    tmp.replace(path)


def load_sequences(path: Path) -> list[TrainSequence]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [TrainSequence(str(r["id"]), list(r["input_ids"]), int(r["num_prompt"])) for r in rows]


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] int64, right-padded with 0
    lengths: torch.Tensor  # [B] int64
    loss_mask: torch.Tensor  # [B, S] bool: response tokens (never padding)


def collate(seqs: list[TrainSequence], device: torch.device | str) -> Batch:
    width = max(len(s.input_ids) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, :len(s.input_ids)] = torch.tensor(s.input_ids, dtype=torch.int64)
        mask[b, s.num_prompt:len(s.input_ids)] = True
    lengths = torch.tensor([len(s.input_ids) for s in seqs], dtype=torch.int64)
    return Batch(ids.to(device), lengths.to(device), mask.to(device))


def batch_indices(num_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Items of training step ``step`` (0-based): epochs are seeded permutations walked in
    order, so the order depends only on (seed, step) and a resumed run sees the same batches."""
    per_epoch = max(1, math.ceil(num_items / batch_size))
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    perm = torch.randperm(num_items, generator=g).tolist()
    return perm[k * batch_size:(k + 1) * batch_size]


class TargetFeaturizer:
    """Runs the (frozen) target over whole training sequences and returns what the draft learns
    from: the aux hidden states (EAGLE-3 input) and the target logits (soft labels).

    The sequences are packed into one flat token batch over a private paged KV cache, so padding
    costs nothing and the target runs its real attention path (paged op: Triton on GPU). The cache
    is bound only for the call; the target's previous caches (e.g. the engine's) are restored.
    """

    def __init__(self, target: CausalLM, aux_layer_ids: tuple[int, ...],
                 vocab_ids: torch.Tensor | None = None, page_size: int = 16) -> None:
        self.target = target
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.page_size = page_size
        w = target.lm_head.weight
        # Logits only at the draft vocab: [B, S, V] fp32 would dominate memory for 128k vocabs.
        self.head = w if vocab_ids is None else w[vocab_ids.to(w.device)]  # [V_out, h]
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._num_blocks = 0

    def _ensure_cache(self, num_blocks: int) -> None:
        if num_blocks <= self._num_blocks:
            return
        cfg, p = self.target.config, self.target.lm_head.weight
        self._caches = [allocate_kv_pair(num_blocks, self.page_size, cfg.num_key_value_heads,
                                         cfg.head_dim, p.dtype, p.device)
                        for _ in range(cfg.num_hidden_layers)]
        self._num_blocks = num_blocks

    @torch.no_grad()  # not inference_mode: the outputs feed autograd (fc saves its input)
    def __call__(self, input_ids: torch.Tensor,  # [B, S] int64, right-padded
                 lengths: torch.Tensor,  # [B]
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # (aux [B, S, n*h], logits [B, S, V_out])
        b, s = input_ids.shape
        device = input_ids.device
        lens = [int(n) for n in lengths.tolist()]
        alloc = BlockAllocator(sum(-(-n // self.page_size) for n in lens), self.page_size)
        self._ensure_cache(alloc.num_blocks)
        for i, n in enumerate(lens):
            alloc.grow(i, n)
        positions, meta = build_metadata(alloc, [Span(i, 0, n) for i, n in enumerate(lens)],
                                         device)
        valid = torch.arange(s, device=device)[None, :] < lengths[:, None]  # [B, S]
        flat_ids = input_ids[valid]  # [T] row-major == the spans' order
        layers = self.target.model.layers
        saved = [(l.self_attn.k_cache, l.self_attn.v_cache) for l in layers]
        self.target.bind_kv_cache(self._caches)
        try:
            final, aux = self.target(flat_ids, positions, meta, self.aux_layer_ids)
        finally:
            for l, (k, v) in zip(layers, saved):
                l.self_attn.k_cache, l.self_attn.v_cache = k, v
        logits = F.linear(final, self.head).float()  # [T, V_out]
        aux_cat = torch.cat(aux, dim=-1)  # [T, n*h]
        aux_out = aux_cat.new_zeros(b, s, aux_cat.shape[-1])
        logit_out = logits.new_zeros(b, s, logits.shape[-1])
        aux_out[valid] = aux_cat
        logit_out[valid] = logits
        return aux_out, logit_out
