"""The trainer's corpus: prompt sources, the held-out split, self-distilled sequences on disk, and
the draft vocabulary chosen from them.

Sources are single-turn prompt files (JSONL) and ShareGPT conversations (``sharegpt.py``); both
become chat jobs the target answers (``multiturn.py``). The split is a seeded random sample over
all of them, so held-out figures cover every kind of prompt; they are reported per kind.
"""
from __future__ import annotations

import gc
import json
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from compiled_spec.train.data import (PromptRow, TrainSequence, load_prompts, load_sequences,
                                      save_sequences)
from compiled_spec.train.heldout import split_prompts
from compiled_spec.train.sharegpt import Conversation, load_sharegpt
from compiled_spec.train.vocab import count_tokens, select_draft_vocab

if TYPE_CHECKING:
    from compiled_spec.models.decoder import CausalLM
    from compiled_spec.train.config import TrainConfig

DATA_FILE = "data.jsonl"
VAL_FILE = "val.jsonl"
PARTIAL_FILE = "data.partial.jsonl"
VOCAB_FILE = "vocab.json"


def load_rows(cfg: "TrainConfig") -> list[PromptRow | Conversation]:
    """Every prompt and conversation the config names (prompt files first)."""
    rows: list[PromptRow | Conversation] = []
    if cfg.prompts:
        rows += load_prompts(cfg.prompts, cfg.num_prompts)
    if cfg.sharegpt:
        convs, stats = load_sharegpt(None if cfg.sharegpt == "package" else cfg.sharegpt,
                                     cfg.sharegpt_conversations, cfg.max_turns)
        print(f"ShareGPT: {stats.records} records read, {stats.conversations} conversations "
              f"kept ({sum(len(c.user_turns) for c in convs)} user turns), {stats.skipped} "
              f"skipped" + (f", file cut off mid-record ({stats.tail_bytes} bytes dropped)"
                            if stats.truncated else ""))
        rows += convs
    return rows


def load_corpus(cfg: "TrainConfig", out: Path
                ) -> tuple["CausalLM", list[TrainSequence], list[TrainSequence]]:
    """The target, plus the (training, held-out) sequences: read back from out/ when a previous
    run wrote them, else generated now (resuming a generation that was cut short: sequences in
    out/data.partial.jsonl are kept and their jobs skipped, out/val.jsonl is reused)."""
    from compiled_spec.config import resolve_device, resolve_dtype

    data_file, val_file = out / DATA_FILE, out / VAL_FILE
    device = resolve_device(cfg.device)
    if data_file.is_file():
        from compiled_spec.models.loader import load_model

        print(f"reusing the self-distilled data in {data_file}")
        val = load_sequences(val_file) if val_file.is_file() else []
        return load_model(cfg.target, resolve_dtype(cfg.dtype, device), device)[0], \
            load_sequences(data_file), val
    from compiled_spec.llm import LLM
    from compiled_spec.train.multiturn import generate_sequences

    train_rows, val_rows = split_prompts(load_rows(cfg), cfg.val_prompts, cfg.seed)
    if cfg.gen_shard is not None and cfg.gen_shard[0] > 0:
        val_rows = []  # shard 0 answers the held-out prompts
    llm = LLM(model=cfg.target, tokenizer=cfg.tokenizer, dtype=cfg.dtype, device=device,
              max_model_len=cfg.max_seq_len, max_num_seqs=cfg.gen_batch_size, seed=cfg.seed,
              # Admissions in bulk (a sixteenth of the batch at a time, up to 32 prompt tokens
              # per slot per step): a step with a prompt runs without a CUDA graph and cost
              # ~44 ms on the H200 at batch 1,024, 70% of generation time when every freed slot
              # was refilled at once (results/2026-12-01_h200_session5/).
              max_num_batched_tokens=max(4096, 32 * cfg.gen_batch_size),
              min_admit=max(1, cfg.gen_batch_size // 16),
              kv_cache_memory_gib=cfg.gen_kv_gib,
              compile=cfg.gen_compile, compile_config=_gen_compile_config(cfg))
    deadline = (None if cfg.gen_time_limit_s is None
                else time.monotonic() + cfg.gen_time_limit_s)
    gen = dict(max_new_tokens=cfg.max_new_tokens, max_seq_len=cfg.max_seq_len,
               batch_size=cfg.gen_batch_size, seed=cfg.seed, ignore_eos=cfg.ignore_eos,
               partial=out / PARTIAL_FILE, deadline=deadline)
    # A held-out file from an earlier run (the split is seeded, so the same prompts) is reused:
    # held-out figures stay comparable across runs and sessions.
    if val_file.is_file() and val_rows:
        val = load_sequences(val_file)
        print(f"reusing the held-out sequences in {val_file}")
    else:
        val = generate_sequences(llm, val_rows, temperatures=_heldout_temperatures(cfg), **gen) \
            if val_rows else []
    seqs = generate_sequences(llm, train_rows, temperatures=cfg.temperatures,
                              shard=cfg.gen_shard, skip=cfg.gen_skip, round_=cfg.gen_round, **gen)
    save_sequences(val_file, val)
    save_sequences(data_file, seqs)
    (out / PARTIAL_FILE).unlink(missing_ok=True)
    model = llm.engine.model
    # The engine's KV pool (half the free GPU memory by default) stays bound to the layers while
    # they live: unbind it, so training (features, draft, activations) gets that memory back.
    for layer in model.model.layers:
        layer.self_attn.k_cache = layer.self_attn.v_cache = None
    del llm
    gc.collect()  # the engine's reference cycles, with the pool's and graphs' tensors
    return model, seqs, val


def _heldout_temperatures(cfg: "TrainConfig") -> tuple[float, ...]:
    """The held-out prompts' one temperature. They are always answered as round 0 (same ids and
    seeds), greedy as round 0 answered them, also in a later round (whose temperatures are all
    > 0), so held-out figures stay comparable across rounds and sessions."""
    return cfg.temperatures[:1] if cfg.gen_round == 0 else (0.0,)


def _gen_compile_config(cfg: "TrainConfig"):
    """Large-batch generation graphs: a few power-of-two sizes up to the batch (capturing every
    multiple of 8 would cost minutes of start-up)."""
    if not cfg.gen_compile:
        return None
    from compiled_spec.compile import CompileConfig

    sizes, n = [], 1
    while n < cfg.gen_batch_size:
        sizes.append(n)
        n *= 2
    return CompileConfig(capture_batch_sizes=tuple(sizes + [cfg.gen_batch_size]))


def choose_vocab(seqs: list[TrainSequence], size: int, target_vocab: int, out: Path
                 ) -> torch.Tensor:  # [size] ascending target ids
    """The draft vocabulary: the most frequent tokens of the target's own replies. Its coverage
    of the replies, overall and per prompt kind, bounds acceptance and goes to out/vocab.json."""
    by_kind: dict[str, Counter[int]] = {}  # reply tokens per prompt kind, one pass over them
    for s in seqs:
        by_kind.setdefault(s.kind or "unknown", Counter()).update(s.response_ids())
    counts = sum(by_kind.values(), Counter())
    prompt_counts = count_tokens(s.input_ids[:s.loss_spans()[0][0]] for s in seqs)
    draft_ids = select_draft_vocab(counts, min(size, target_vocab), target_vocab, prompt_counts)
    kept = set(draft_ids.tolist())
    report = {"draft_vocab_size": draft_ids.numel(), "coverage": _coverage(counts, kept),
              "coverage_by_kind": {k: _coverage(c, kept) for k, c in sorted(by_kind.items())},
              "response_tokens": sum(counts.values())}
    out.joinpath(VOCAB_FILE).write_text(json.dumps(report, indent=1))
    # The draft can never propose a token outside its vocabulary: this bounds acceptance.
    print(f"draft vocab {draft_ids.numel()} covers {report['coverage']:.2%} of response tokens "
          f"({', '.join(f'{k} {v:.2%}' for k, v in report['coverage_by_kind'].items())})")
    return draft_ids


def _coverage(counts: Counter[int], kept: set[int]) -> float:
    total = sum(counts.values())
    return sum(c for t, c in counts.items() if t in kept) / max(1, total)
