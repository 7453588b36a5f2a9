"""Self-distillation data for EAGLE-3 training.

The target answers the training prompts itself (through our engine), so the draft learns the
distribution it will be verified against, not some other model's. A training sequence is
prompt + response token ids with a loss mask over the response. Several responses per prompt (one
per sampling temperature) multiply the data: the labels are the target's full distribution at every
position, so a sampled response is as valid a training sequence as the greedy one and visits states
the greedy one never reaches. The target's features are recomputed per batch (``features.py``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm.auto import tqdm

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
                       max_seq_len: int, temperatures: tuple[float, ...] = (0.0,),
                       batch_size: int = 32, seed: int = 0, ignore_eos: bool = False,
                       partial: Path | None = None) -> list[TrainSequence]:
    """Let the target answer every prompt once per temperature with our engine. Prompts too long
    to leave room for at least two response tokens within ``max_seq_len`` are skipped.

    With ``partial``, finished chunks are appended there as they complete and the rows already in
    it are not generated again, so a generation cut short (a time limit) resumes where it stopped.
    """
    from compiled_spec.sampling_params import SamplingParams

    done: dict[str, TrainSequence] = {}
    if partial is not None and partial.is_file():
        done = {s.id: s for s in load_sequences(partial, strict=False)}
    jobs: list[tuple[str, list[int], float, int]] = []  # (sequence id, prompt ids, temp, seed)
    for row in prompts:
        ids = row.ids if row.ids is not None else llm.encode_chat(
            [{"role": "user", "content": row.text}])
        if len(ids) > max_seq_len - 2:
            continue
        for ti, temp in enumerate(temperatures):
            sid = row.id if ti == 0 else f"{row.id}#t{ti}"
            jobs.append((sid, ids, temp, seed * 1_000_003 + len(jobs)))
    out: list[TrainSequence] = [done[j[0]] for j in jobs if j[0] in done]
    todo = [j for j in jobs if j[0] not in done]
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="self-distill",
               unit="seq")
    # Chunks of several engine batches: continuous batching refills the slots of responses that
    # end early, and each finished chunk is one append to ``partial``.
    chunk_size = 4 * batch_size
    for start in range(0, len(todo), chunk_size):
        chunk = todo[start:start + chunk_size]
        params = [SamplingParams(max_tokens=min(max_new_tokens, max_seq_len - len(ids)),
                                 temperature=temp, seed=sd, ignore_eos=ignore_eos)
                  for _, ids, temp, sd in chunk]
        new: list[TrainSequence] = []
        for (sid, ids, _, _), res in zip(chunk, llm.generate([j[1] for j in chunk], params)):
            resp = res.outputs[0].token_ids
            if resp:
                new.append(TrainSequence(sid, list(ids) + list(resp), len(ids)))
        if partial is not None:
            with partial.open("a") as f:
                f.write("".join(_row(s) for s in new))
        out.extend(new)
        bar.update(len(chunk))
    bar.close()
    if not out:
        raise ValueError("the target produced no usable training sequences")
    return out


def _row(s: TrainSequence) -> str:
    return json.dumps({"id": s.id, "input_ids": s.input_ids, "num_prompt": s.num_prompt}) + "\n"


def save_sequences(path: Path, seqs: list[TrainSequence]) -> None:
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        f.write("".join(_row(s) for s in seqs))
    tmp.replace(path)


def load_sequences(path: Path, strict: bool = True) -> list[TrainSequence]:
    """Rows written by ``save_sequences``; ``strict=False`` drops a torn last line (a partial
    file whose writer was killed mid-append)."""
    out = []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    for n, line in enumerate(lines, 1):
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            if strict or n != len(lines):
                raise ValueError(f"{path}:{n}: malformed row") from None
            continue
        out.append(TrainSequence(str(r["id"]), list(r["input_ids"]), int(r["num_prompt"])))
    return out


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


