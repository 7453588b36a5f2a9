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
from dataclasses import asdict
from pathlib import Path

import torch

from compiled_spec.draft.config import DraftConfig
from compiled_spec.draft.model import EagleDraft
from compiled_spec.models.decoder import CausalLM
from compiled_spec.train import checkpoint as ckpt
from compiled_spec.train.corpus import choose_vocab, load_corpus
from compiled_spec.train.data import Batches
from compiled_spec.train.features import TargetFeaturizer
from compiled_spec.train.heldout import evaluate
from compiled_spec.train.logs import LOG_FILE, plot_curves, read_log, truncate_log
from compiled_spec.train.config import TrainConfig
from compiled_spec.train.step import TTTStep
from compiled_spec.train.vocab import vocab_maps

BEST_DIR = "best"
__all__ = ["TrainConfig", "train", "read_log", "plot_curves", "default_aux_layer_ids"]


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's (2, L//2, L-3); shallow test targets (L < 6) spread over [0, L] instead, since
    L-3 would be negative there (id L is the stream after the last layer)."""
    if num_layers >= 6:
        return (2, num_layers // 2, num_layers - 3)
    return (0, num_layers // 2, num_layers)


def lr_at(cfg: TrainConfig, step: int, total: int, time_frac: float = 0.0) -> float:
    """Learning rate of 0-based ``step``: linear warm-up, then the chosen decay to 0 (over the
    steps, or over ``time_frac`` of the time limit when that is further along)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    frac = max((step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps), time_frac)
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
        ckpt.load_head_into(draft, init, grow=True)  # deeper than init: identity layers added
    if resuming:
        ckpt.load_head_into(draft, out)
        state = ckpt.load_state(out, device)
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
    truncate_log(out / LOG_FILE, start)

    feats = TargetFeaturizer(target, draft.aux_layer_ids, draft_ids,
                             compiled=cfg.compile_features)
    ttt = TTTStep(feats, cfg)
    batches = Batches(seqs, cfg.batch_size, cfg.batch_tokens, cfg.seed,
                      ttt.budget if ttt.packed else None)
    total = cfg.steps if cfg.epochs is None else max(
        1, math.ceil(cfg.epochs * batches.per_epoch))
    draft.train()
    window: list[tuple[float, list[float]]] = []
    t0 = time.perf_counter()
    tokens = 0  # real (unpadded) tokens trained on since t0
    done = start
    with (out / LOG_FILE).open("a") as log:
        for step in range(start, total):
            time_frac = ((time.perf_counter() - t0) / cfg.time_limit_s
                         if cfg.lr_by_time and cfg.time_limit_s else 0.0)
            lr = lr_at(cfg, step, total, time_frac)
            for g in opt.param_groups:
                g["lr"] = lr
            res, n_tokens = ttt(draft, batches.at(step))
            tokens += n_tokens
            opt.zero_grad(set_to_none=True)
            res.loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            window.append((sum(cfg.ttt_decay ** i * l for i, l in enumerate(res.step_losses)),
                           res.step_accuracy))
            done = step + 1
            # Checked after the step, so the last step is logged, evaluated and saved below.
            time_up = (cfg.time_limit_s is not None and done < total
                       and time.perf_counter() - t0 > cfg.time_limit_s)
            last = done == total or time_up
            if done % cfg.log_every == 0 or last:
                n = len(window)
                row = {"step": done, "loss": sum(w[0] for w in window) / n,
                       "acc": [sum(w[1][i] for w in window) / n for i in range(cfg.ttt_steps)],
                       "lr": lr, "elapsed_s": round(time.perf_counter() - t0, 3),
                       "tokens_per_s": round(tokens / max(time.perf_counter() - t0, 1e-9))}
                if val and (done % cfg.eval_every == 0 or last):
                    ev = evaluate(draft, ttt, val)
                    row["val_loss"], row["val_acc"] = ev.loss, ev.accuracy
                    row["val_acc_by_kind"] = ev.accuracy_by_kind
                    if ev.accuracy_novel:
                        row["val_acc_novel"] = ev.accuracy_novel
                    _keep_best(draft, t2d, out, done, ev.loss)
                log.write(json.dumps(row) + "\n")
                log.flush()
                window.clear()
            if cfg.save_every and done % cfg.save_every == 0 and done < total:
                _save(draft, t2d, out, done, opt)
            if time_up:
                print(f"time limit {cfg.time_limit_s:.0f} s reached after step {done} of "
                      f"{total}; continue with --resume")
                break
    _save(draft, t2d, out, max(done, start), opt)
    plot_curves(out)
    if cfg.export_dir:
        best = out / BEST_DIR
        src = best if (best / "config.json").is_file() else out
        files = ckpt.export_head(src, cfg.export_dir, "bfloat16", cfg.export_max_shard_mb)
        print(f"exported {src} as bf16 to {cfg.export_dir} ({len(files)} files)")
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
