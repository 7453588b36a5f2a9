"""``train(cfg)``: self-distil a target, pick the draft vocabulary, train an EAGLE-3 head with
training-time test, and save it in the published layout (resumable, logged, plotted).

out/ holds: ``data.jsonl`` (the generated sequences, reused on resume), ``config.json`` +
``model.safetensors`` (the head, loadable by ``load_draft`` and public EAGLE-3 loaders),
``trainer_state.pt`` (step + optimizer), ``train_log.jsonl`` and ``train_curves.png``; with held-out
prompts also ``val.jsonl`` and ``best/`` (the head with the lowest held-out loss so far).
"""
from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from compiled_spec.config import resolve_device, resolve_dtype
from compiled_spec.draft.config import DraftConfig
from compiled_spec.draft.model import EagleDraft
from compiled_spec.models.decoder import CausalLM
from compiled_spec.train import checkpoint as ckpt
from compiled_spec.train.data import (TrainSequence, batch_indices, collate, generate_sequences,
                                      load_prompts, load_sequences, save_sequences)
from compiled_spec.train.features import TargetFeaturizer
from compiled_spec.train.heldout import evaluate, split_prompts
from compiled_spec.train.logs import LOG_FILE, plot_curves, read_log, truncate_log
from compiled_spec.train.ttt import ttt_loss
from compiled_spec.train.vocab import count_tokens, select_draft_vocab, vocab_maps

DATA_FILE = "data.jsonl"
VAL_FILE = "val.jsonl"
PARTIAL_FILE = "data.partial.jsonl"
BEST_DIR = "best"
__all__ = ["TrainConfig", "train", "read_log", "plot_curves", "default_aux_layer_ids"]


@dataclass
class TrainConfig:
    target: str  # HF directory or .gguf
    prompts: str  # JSONL of {"id", "prompt"} or {"id", "prompt_ids"}
    out: str
    tokenizer: str | None = None  # default: the target's own
    draft_vocab_size: int = 32000  # clipped to the target vocab
    num_layers: int = 1
    ttt_steps: int = 3
    ttt_decay: float = 0.8  # weight of step s is decay^(s-1)
    aux_layer_ids: tuple[int, ...] | None = None  # default: default_aux_layer_ids(L)
    lr: float = 1e-4
    weight_decay: float = 0.0
    warmup_steps: int = 50
    schedule: str = "cosine"  # decay after warm-up: "cosine" | "linear" | "constant"
    steps: int = 1000
    epochs: float | None = None  # when set, overrides steps: epochs * batches per epoch
    batch_size: int = 8
    max_seq_len: int = 2048
    max_new_tokens: int = 512
    num_prompts: int | None = None
    temperatures: tuple[float, ...] = (0.0,)  # one response per prompt per temperature
    val_prompts: int = 0  # prompts held out (greedy responses only) for the held-out loss
    eval_every: int = 250  # steps between held-out evaluations (and best-head saves)
    data_only: bool = False  # stop once the self-distilled data is written
    ignore_eos: bool = False
    gen_batch_size: int = 32
    grad_clip: float = 0.5
    dtype: str = "auto"  # target dtype: bf16 on GPU (draft trains under bf16 autocast), fp32 CPU
    device: str | None = None
    seed: int = 0
    save_every: int = 500
    log_every: int = 10
    resume: bool = False
    init_from: str | None = None  # warm start: a head (dir or shipped name) of this target

    def __post_init__(self) -> None:
        for name in ("draft_vocab_size", "num_layers", "ttt_steps", "steps", "batch_size",
                     "max_seq_len", "max_new_tokens", "gen_batch_size", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TrainConfig.{name}={v!r}: must be a positive integer")
        for name in ("warmup_steps", "save_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name}={v!r}: must be an integer >= 0")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"TrainConfig.num_prompts={self.num_prompts!r}: must be >= 1")
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"TrainConfig.epochs={self.epochs!r}: must be > 0")
        if not self.lr > 0 or self.weight_decay < 0 or not self.grad_clip > 0:
            raise ValueError("TrainConfig: lr and grad_clip must be > 0, weight_decay >= 0")
        self.temperatures = tuple(float(t) for t in self.temperatures)
        if not self.temperatures or any(t < 0 for t in self.temperatures):
            raise ValueError(f"TrainConfig.temperatures={self.temperatures!r}: one or more "
                             "values >= 0")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"TrainConfig.ttt_decay={self.ttt_decay!r}: must be in (0, 1]")
        for name in ("val_prompts", "eval_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (name == "eval_every"):
                raise ValueError(f"TrainConfig.{name}={v!r}: must be an integer >= "
                                 f"{int(name == 'eval_every')}")
        if self.schedule not in ("cosine", "linear", "constant"):
            raise ValueError(f"TrainConfig.schedule={self.schedule!r}: cosine|linear|constant")
        if self.aux_layer_ids is not None:
            self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's (2, L//2, L-3); shallow test targets (L < 6) spread over [0, L] instead, since
    L-3 would be negative there (id L is the stream after the last layer)."""
    if num_layers >= 6:
        return (2, num_layers // 2, num_layers - 3)
    return (0, num_layers // 2, num_layers)


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """Learning rate of 0-based ``step``: linear warm-up, then the chosen decay to 0."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    if cfg.schedule == "linear":
        return cfg.lr * max(0.0, 1.0 - frac)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(1.0, frac)))


def build_head(target: CausalLM, cfg: TrainConfig, draft_ids: torch.Tensor) -> EagleDraft:
    """A fresh EAGLE-3 head shaped like one target layer, in fp32 on the target's device."""
    t = target.config
    dc = DraftConfig(
        method="eagle3", hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim,
        rms_norm_eps=t.rms_norm_eps, rope_theta=t.rope_theta, rope_scaling=t.rope_scaling,
        max_position_embeddings=t.max_position_embeddings, draft_vocab_size=draft_ids.numel(),
        target_hidden_size=t.hidden_size,
        aux_layer_ids=cfg.aux_layer_ids or default_aux_layer_ids(t.num_hidden_layers),
        target_vocab_size=t.vocab_size)
    device = target.lm_head.weight.device
    torch.manual_seed(cfg.seed)
    draft = EagleDraft(dc, target).to(device=device, dtype=torch.float32)
    with torch.no_grad():
        d2t, _ = vocab_maps(draft_ids, t.vocab_size)
        draft.d2t = d2t.to(device)
        # The draft's logits start as the target's own readout at the draft vocab: same rows of
        # lm_head behind the same final-norm weights.
        draft.lm_head.weight.copy_(target.lm_head.weight[draft_ids.to(device)].float())
        draft.norm.weight.copy_(target.model.norm.weight.float())
    return draft


def _load_target(cfg: TrainConfig, out: Path
                 ) -> tuple[CausalLM, list[TrainSequence], list[TrainSequence]]:
    """The target, plus the (training, held-out) sequences: read back from out/ when a previous
    run wrote them, else generated now (resuming a generation that was cut short)."""
    data_file, val_file = out / DATA_FILE, out / VAL_FILE
    device = resolve_device(cfg.device)
    if data_file.is_file():
        from compiled_spec.models.loader import load_model

        print(f"reusing the self-distilled data in {data_file}")
        val = load_sequences(val_file) if val_file.is_file() else []
        return load_model(cfg.target, resolve_dtype(cfg.dtype, device), device)[0], \
            load_sequences(data_file), val
    from compiled_spec.llm import LLM

    train_rows, val_rows = split_prompts(load_prompts(cfg.prompts, cfg.num_prompts), cfg.val_prompts,
                                  cfg.seed)
    llm = LLM(model=cfg.target, tokenizer=cfg.tokenizer, dtype=cfg.dtype, device=device,
              max_model_len=cfg.max_seq_len, max_num_seqs=cfg.gen_batch_size, seed=cfg.seed,
              max_num_batched_tokens=max(4096, 16 * cfg.gen_batch_size))
    gen = dict(max_new_tokens=cfg.max_new_tokens, max_seq_len=cfg.max_seq_len,
               batch_size=cfg.gen_batch_size, seed=cfg.seed, ignore_eos=cfg.ignore_eos,
               partial=out / PARTIAL_FILE)
    val = generate_sequences(llm, val_rows, temperatures=cfg.temperatures[:1], **gen) \
        if val_rows else []
    seqs = generate_sequences(llm, train_rows, temperatures=cfg.temperatures, **gen)
    save_sequences(val_file, val)
    save_sequences(data_file, seqs)
    (out / PARTIAL_FILE).unlink(missing_ok=True)
    return llm.engine.model, seqs, val


def train(cfg: TrainConfig) -> Path:
    """Train (or resume) the head described by ``cfg``; returns the output directory."""
    out = Path(cfg.out)
    state_file = out / ckpt.STATE_FILE
    if state_file.exists() and not cfg.resume:
        raise ValueError(f"{out} already holds a training run; pass resume=True (--resume) to "
                         "continue it or choose another output directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    target, seqs, val = _load_target(cfg, out)
    if cfg.data_only:
        print(f"data written: {len(seqs)} training and {len(val)} held-out sequences in {out}")
        return out
    device = target.lm_head.weight.device
    vocab = target.config.vocab_size

    resuming = cfg.resume and state_file.exists()
    init = None
    if cfg.init_from and not resuming:
        from compiled_spec.heads import resolve_draft

        init = Path(resolve_draft(cfg.init_from))
    if resuming or init is not None:  # the vocabulary is part of the saved head
        from safetensors import safe_open

        d2t = None
        for path in ckpt.head_files(out if resuming else init):
            with safe_open(str(path), framework="pt") as f:
                if "d2t" in f.keys():
                    d2t = f.get_tensor("d2t")
        if d2t is None:
            raise ValueError(f"{out if resuming else init}: head has no d2t")
        draft_ids = torch.arange(d2t.numel()) + d2t
    else:
        counts = count_tokens(s.input_ids[s.num_prompt:] for s in seqs)
        draft_ids = select_draft_vocab(counts, min(cfg.draft_vocab_size, vocab), vocab,
                                       count_tokens(s.input_ids[:s.num_prompt] for s in seqs))
        kept = set(draft_ids.tolist())
        covered = sum(c for t, c in counts.items() if t in kept) / max(1, sum(counts.values()))
        # The draft can never propose a token outside its vocabulary: this bounds acceptance.
        print(f"draft vocab {draft_ids.numel()} covers {covered:.2%} of response tokens")
    draft = build_head(target, cfg, draft_ids)
    _, t2d = vocab_maps(draft_ids, vocab)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    start = 0
    if init is not None:
        ckpt.load_head_into(draft, init)
    if resuming:
        ckpt.load_head_into(draft, out)
        state = ckpt.load_state(out, device)
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    truncate_log(out / LOG_FILE, start)

    total = cfg.steps if cfg.epochs is None else max(
        1, math.ceil(cfg.epochs * math.ceil(len(seqs) / cfg.batch_size)))
    feats = TargetFeaturizer(target, draft.aux_layer_ids, draft_ids)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                and target.lm_head.weight.dtype == torch.bfloat16 else nullcontext())
    draft.train()
    window: list[tuple[float, list[float]]] = []
    t0 = time.perf_counter()
    with (out / LOG_FILE).open("a") as log:
        for step in range(start, total):
            lr = lr_at(cfg, step, total)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = collate([seqs[i] for i in batch_indices(len(seqs), cfg.batch_size, step,
                                                            cfg.seed)], device)
            aux, tlogits = feats(batch.input_ids, batch.lengths)  # [B,S,3h], [B,S,V_draft]
            with autocast:
                res = ttt_loss(draft, batch.input_ids, aux, tlogits, batch.loss_mask,
                               cfg.ttt_steps, cfg.ttt_decay)
            opt.zero_grad(set_to_none=True)
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            window.append((sum(cfg.ttt_decay ** i * l for i, l in enumerate(res.step_losses)),
                           res.step_accuracy))
            done = step + 1
            if done % cfg.log_every == 0 or done == total:
                n = len(window)
                row = {"step": done, "loss": sum(w[0] for w in window) / n,
                       "acc": [sum(w[1][i] for w in window) / n for i in range(cfg.ttt_steps)],
                       "lr": lr, "elapsed_s": round(time.perf_counter() - t0, 3)}
                if val and (done % cfg.eval_every == 0 or done == total):
                    row["val_loss"], row["val_acc"] = evaluate(draft, feats, val, cfg, autocast)
                    _keep_best(draft, t2d, out, done, row["val_loss"])
                log.write(json.dumps(row) + "\n")
                log.flush()
                window.clear()
            if cfg.save_every and done % cfg.save_every == 0 and done < total:
                _save(draft, t2d, out, done, opt)
    _save(draft, t2d, out, max(total, start), opt)
    plot_curves(out)
    return out


def _keep_best(draft: EagleDraft, t2d: torch.Tensor, out: Path, step: int, val_loss: float
               ) -> None:
    """Save the head to out/best/ when its held-out loss is the lowest seen (across resumes)."""
    best, info = out / BEST_DIR, out / BEST_DIR / "best.json"
    if info.is_file() and json.loads(info.read_text())["val_loss"] <= val_loss:
        return
    ckpt.save_head(draft, t2d, best)
    info.write_text(json.dumps({"step": step, "val_loss": val_loss}))


def _save(draft: EagleDraft, t2d: torch.Tensor, out: Path, step: int,
          opt: torch.optim.Optimizer) -> None:
    ckpt.save_head(draft, t2d, out)
    ckpt.save_state(out, step, opt)


