"""Self-distillation data for EAGLE-3 training.

The target answers the training prompts itself (through our engine), so the draft learns the
distribution it will be verified against, not some other model's. A training sequence is
prompt + response token ids with a loss mask over the response. Several responses per prompt (one
per sampling temperature) multiply the data: the labels are the target's full distribution at every
position, so a sampled response is as valid a training sequence as the greedy one and visits states
the greedy one never reaches. The target's features are recomputed per batch (``features.py``);
the generation itself is ``multiturn.py``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class PromptRow:
    id: str
    text: str | None  # chat-templated with the target's template
    ids: list[int] | None  # used verbatim (``prompt_ids`` rows: no template)
    source: str = ""  # where the prompt comes from (held-out figures are reported per kind)


@dataclass
class TrainSequence:
    id: str
    input_ids: list[int]  # prompt + response(s), target vocab
    num_prompt: int  # without spans: the loss covers input_ids[num_prompt:]
    # [start, end) ranges of the target's own tokens (every assistant turn of a multi-turn
    # conversation); None: the single response after num_prompt.
    spans: list[tuple[int, int]] | None = None
    kind: str = ""  # "prose" | "code" | ... (see ``prompt_kind``)

    def loss_spans(self) -> list[tuple[int, int]]:
        return self.spans if self.spans is not None else [(self.num_prompt, len(self.input_ids))]

    def response_ids(self) -> list[int]:
        return [t for a, b in self.loss_spans() for t in self.input_ids[a:b]]

    def copyable(self) -> list[bool]:
        """Per token p: the bigram before it already occurred earlier in the sequence, followed
        by this same token (a lookup in the context predicts it). Long greedy replies of a small
        target loop: on the held-out chat data 77% of reply tokens are copyable, on MT-bench
        answers about half, so accuracy on the others is reported apart. Cached."""
        cached = self.__dict__.get("_copyable")
        if cached is None:
            ids, seen = self.input_ids, {}
            cached = [False, False][:len(ids)]
            for p in range(2, len(ids)):
                key = (ids[p - 2], ids[p - 1])
                cached.append(seen.get(key) == ids[p])
                seen[key] = ids[p]
            self.__dict__["_copyable"] = cached
        return cached


def prompt_kind(source: str) -> str:
    """The kind of a prompt source, for held-out figures: code data sets, multi-turn chat
    (ShareGPT), and single-turn prose instructions. MT-bench is prose and chat, so those two
    figures are the headline."""
    src = source.lower()
    return "code" if "code" in src else "chat" if "sharegpt" in src else "prose"


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
        rid, src = str(r.get("id", n)), str(r.get("source", ""))
        if isinstance(r.get("prompt_ids"), list):
            ids = r["prompt_ids"]
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{path}:{n}: prompt_ids must be a non-empty list of ints")
            rows.append(PromptRow(rid, None, list(ids), src))
        elif isinstance(r.get("prompt"), str) and r["prompt"]:
            rows.append(PromptRow(rid, r["prompt"], None, src))
        else:
            raise ValueError(f"{path}:{n}: expected a non-empty 'prompt' string or 'prompt_ids'")
        if num_prompts is not None and len(rows) >= num_prompts:
            break
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _row(s: TrainSequence) -> str:
    row: dict = {"id": s.id, "input_ids": s.input_ids, "num_prompt": s.num_prompt}
    if s.spans is not None:
        row["spans"] = s.spans
    if s.kind:
        row["kind"] = s.kind
    return json.dumps(row) + "\n"


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
        spans = r.get("spans")
        out.append(TrainSequence(str(r["id"]), list(r["input_ids"]), int(r["num_prompt"]),
                                 None if spans is None else [(int(a), int(b)) for a, b in spans],
                                 str(r.get("kind", ""))))
    return out


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, S] int64, right-padded with 0
    lengths: torch.Tensor  # [B] int64
    loss_mask: torch.Tensor  # [B, S] bool: response tokens (never padding)
    num_tokens: int = 0  # real tokens (sum of lengths), known on the host


def collate(seqs: list[TrainSequence], device: torch.device | str) -> Batch:
    width = max(len(s.input_ids) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.int64)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for b, s in enumerate(seqs):
        ids[b, :len(s.input_ids)] = torch.tensor(s.input_ids, dtype=torch.int64)
        for start, end in s.loss_spans():
            mask[b, start:end] = True
    lens = [len(s.input_ids) for s in seqs]
    lengths = torch.tensor(lens, dtype=torch.int64)
    return Batch(ids.to(device), lengths.to(device), mask.to(device), sum(lens))


def length_batches(lengths: list[int], batch_tokens: int, seed: int,
                   pool: int = 64) -> list[list[int]]:
    """One epoch of length-grouped batches: a seeded shuffle, cut into pools of ``pool``
    batches' worth of sequences, each pool sorted by length and cut greedily so that a batch's
    padded size (count x its longest) stays within ``batch_tokens``; batch order shuffled again.
    Padding is then a few percent, where random batches of mixed chat lengths waste most."""
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=g).tolist()
    mean = max(1, sum(lengths) // max(1, len(lengths)))
    pool_size = max(1, pool * batch_tokens // mean)
    batches: list[list[int]] = []
    for start in range(0, len(order), pool_size):
        chunk = sorted(order[start:start + pool_size], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in chunk:  # ascending: the newest sequence is the longest in the batch
            if cur and (len(cur) + 1) * lengths[i] > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]


def pack_batches(lengths: list[int], budget: int, seed: int, window: int = 64
                 ) -> list[list[int]]:
    """One epoch: sequences in a seeded random order, each into the first of the last
    ``window`` batches with room for it (else a new batch), batch order shuffled again. Random
    chat lengths fill batches to within a few percent of the budget."""
    if lengths and max(lengths) > budget:
        raise ValueError(f"a sequence of {max(lengths)} tokens does not fit a packed batch of "
                         f"{budget} tokens")
    g = torch.Generator().manual_seed(seed)
    bins: list[list[int]] = []
    room: list[int] = []
    for i in torch.randperm(len(lengths), generator=g).tolist():
        n = lengths[i]
        for b in range(max(0, len(bins) - window), len(bins)):
            if room[b] >= n:
                bins[b].append(i)
                room[b] -= n
                break
        else:
            bins.append([i])
            room.append(budget - n)
    perm = torch.randperm(len(bins), generator=g).tolist()
    return [bins[i] for i in perm]


def batch_indices(num_items: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Items of training step ``step`` (0-based): epochs are seeded permutations walked in
    order, so the order depends only on (seed, step) and a resumed run sees the same batches."""
    per_epoch = max(1, math.ceil(num_items / batch_size))
    epoch, k = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    perm = torch.randperm(num_items, generator=g).tolist()
    return perm[k * batch_size:(k + 1) * batch_size]


class Batches:
    """Which sequences make training step ``step``: a pure function of (seed, step), so a
    resumed run sees the same batches. Fixed-size random batches, with ``batch_tokens``
    length-grouped ones (``length_batches``), or with ``packed_budget`` packed ones
    (``pack_batches``), one seeded plan per epoch; plans of different epochs may hold
    different numbers of batches, so steps walk them cumulatively."""

    def __init__(self, seqs: list[TrainSequence], batch_size: int, batch_tokens: int | None,
                 seed: int, packed_budget: int | None = None) -> None:
        self.seqs, self.batch_size, self.batch_tokens, self.seed = (seqs, batch_size,
                                                                    batch_tokens, seed)
        self.packed_budget = packed_budget  # set: packed batches of this many tokens
        self._lengths = [len(s.input_ids) for s in seqs]
        self._plans: list[list[list[int]]] = []  # epochs planned so far, in order
        self.per_epoch = (math.ceil(len(seqs) / batch_size) if self._fixed_size
                          else len(self._plan(0)))

    @property
    def _fixed_size(self) -> bool:
        return self.batch_tokens is None and self.packed_budget is None

    def _plan(self, epoch: int) -> list[list[int]]:
        while len(self._plans) <= epoch:
            seed = self.seed * 7919 + len(self._plans)
            if self.packed_budget is not None:
                self._plans.append(pack_batches(self._lengths, self.packed_budget, seed))
            else:
                self._plans.append(length_batches(self._lengths, self.batch_tokens, seed))
        return self._plans[epoch]

    def at(self, step: int) -> list[TrainSequence]:
        if self._fixed_size:
            idx = batch_indices(len(self.seqs), self.batch_size, step, self.seed)
        else:
            epoch = 0
            while step >= len(self._plan(epoch)):
                step -= len(self._plan(epoch))
                epoch += 1
            idx = self._plan(epoch)[step]
        return [self.seqs[i] for i in idx]
