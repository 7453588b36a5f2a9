"""Issue 14's throughput figures on a SmolLM2-135M-shaped target with random weights (no GGUF
needed): self-distillation tokens/s of our engine at large batch (eager vs compiled + CUDA
graphs), and EAGLE-3 training tokens/s with the target's features computed in the same step
(batch size, compiled TTT step), with a per-phase split of one step.

  python profiles/scripts/train_speed_h200.py --tokenizer TOKDIR --out F.json [--sections gen train]

Random weights write garbage, so generation runs with ignore_eos (fixed reply lengths): the
figure is the engine's, not the model's. Every section has its own time limit.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec.bench.run import LLAMA8B  # noqa: E402

SMOLLM2 = dict(LLAMA8B, vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               max_position_embeddings=8192, rope_theta=100000.0, rope_scaling=None,
               tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


@contextmanager
def time_limit(seconds: int):
    def boom(*_):
        raise TimeoutError(f"section over its {seconds} s limit")
    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def gen_section(model: str, tok: str, batch: int, compiled: bool, n_prompts: int,
                max_tokens: int, device: str) -> dict:
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.compile import CompileConfig

    t0 = time.perf_counter()
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024) if s < batch) + (batch,)
    llm = LLM(model=model, tokenizer=tok, device=device, max_model_len=1024,
              max_num_seqs=batch, max_num_batched_tokens=max(4096, 16 * batch),
              compile=compiled, compile_config=CompileConfig(capture_batch_sizes=sizes)
              if compiled else None)
    startup = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(30, 200))]
               for _ in range(n_prompts)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=1, ignore_eos=True)
    llm.generate(prompts[:batch], SamplingParams(max_tokens=4, ignore_eos=True))  # warm
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    sync()
    dt = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    row = {"section": "generate", "batch": batch, "compiled": compiled, "prompts": n_prompts,
           "new_tokens": toks, "seconds": round(dt, 2), "tokens_per_s": round(toks / dt),
           "startup_s": round(startup, 1)}
    if compiled:
        row["cuda_graphs"] = llm.compile_stats.get("cuda_graphs")
    del llm
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return row


def train_section(model: str, batch_tokens: int, vocab: int, ttt_steps: int, steps: int,
                  compile_ttt: bool, device: str, lengths: list[int],
                  profile_to: str | None = None) -> dict:
    from compiled_spec.models.loader import load_model
    from compiled_spec.train.data import TrainSequence, collate, length_batches
    from compiled_spec.train.features import TargetFeaturizer
    from compiled_spec.train.trainer import TrainConfig, build_head
    from compiled_spec.train.ttt import ttt_loss

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, _ = load_model(model, dtype, dev)
    rng = random.Random(1)
    seqs = [TrainSequence(str(i), [rng.randrange(49152) for _ in range(n)], min(40, n // 2),
                          kind="prose") for i, n in enumerate(lengths)]
    cfg = TrainConfig(target=model, prompts="x", out="/tmp/x", draft_vocab_size=vocab,
                      ttt_steps=ttt_steps, max_seq_len=2048, batch_tokens=batch_tokens)
    draft_ids = torch.randperm(49152)[:vocab].sort().values
    draft = build_head(target, cfg, draft_ids)
    draft.lm_head.weight.requires_grad_(False)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    feats = TargetFeaturizer(target, draft.aux_layer_ids, draft_ids)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
                else nullcontext())
    loss_fn = torch.compile(ttt_loss, dynamic=True) if compile_ttt else ttt_loss
    plan = length_batches([len(s.input_ids) for s in seqs], batch_tokens, 0)
    phases = {"features": 0.0, "forward": 0.0, "backward+opt": 0.0}
    tokens, t_start, done = 0, None, 0
    for k, idx in enumerate(plan[:steps + 2]):
        if k == 2:  # two warm-up steps (allocator, autotuning, compile)
            sync()
            t_start, tokens = time.perf_counter(), 0
            phases = dict.fromkeys(phases, 0.0)
        batch = collate([seqs[i] for i in idx], dev)
        tokens += batch.num_tokens
        prof = None
        if profile_to and k == 3:  # one steady-state step: its kernels, by total GPU time
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else []))
            prof.__enter__()
        t0 = time.perf_counter()
        aux, tl = feats(batch.input_ids, batch.lengths)
        sync(); t1 = time.perf_counter()
        with autocast:
            res = loss_fn(draft, batch.input_ids, aux, tl, batch.loss_mask, ttt_steps, 0.8)
        sync(); t2 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sync(); t3 = time.perf_counter()
        if prof is not None:  # a profiler failure must not cost the section its figures
            try:
                prof.__exit__(None, None, None)
                key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
                Path(profile_to).write_text(prof.key_averages().table(sort_by=key,
                                                                      row_limit=30))
            except Exception as e:  # noqa: BLE001
                Path(profile_to).write_text(f"profiler failed: {type(e).__name__}: {e}\n")
        phases["features"] += t1 - t0
        phases["forward"] += t2 - t1
        phases["backward+opt"] += t3 - t2
        done = k - 1
    dt = time.perf_counter() - t_start
    row = {"section": "train", "batch_tokens": batch_tokens, "draft_vocab": vocab,
           "ttt_steps": ttt_steps, "compiled_ttt": compile_ttt, "steps": done,
           "tokens_per_s": round(tokens / dt),
           "ms_per_step": {k: round(1000 * v / max(done, 1), 1) for k, v in phases.items()},
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
           if dev.type == "cuda" else None}
    del target, draft, opt, feats
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sections", nargs="+", default=["gen", "train"])
    ap.add_argument("--gen-batch", type=int, nargs="+", default=[512])
    ap.add_argument("--gen-prompts", type=int, default=1024)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--train-steps", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--limit", type=int, default=90, help="seconds per section")
    ap.add_argument("--compile-ttt", action="store_true")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="kernel table of one training step (first --batch-tokens value)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(SMOLLM2))
    model = f"random:{tmp}"
    rng = random.Random(2)
    # Lengths like multi-turn chat data: many short single turns, a long tail up to 2048.
    lengths = [min(2048, int(rng.lognormvariate(6.2, 0.7))) + 16 for _ in range(6000)]
    jobs = []
    if "gen" in a.sections:
        for b in a.gen_batch:
            for c in (False, True):
                jobs.append(lambda b=b, c=c: gen_section(model, a.tokenizer, b, c, a.gen_prompts,
                                                         a.gen_tokens, a.device))
    if "train" in a.sections:
        for i, bt in enumerate(a.batch_tokens):
            jobs.append(lambda bt=bt, i=i: train_section(
                model, bt, a.vocab, 5, a.train_steps, False, a.device, lengths,
                a.profile if i == 0 else None))
        if a.compile_ttt:
            jobs.append(lambda: train_section(model, a.batch_tokens[1], a.vocab, 5,
                                              a.train_steps, True, a.device, lengths))
    rows = []
    for job in jobs:
        try:
            with time_limit(a.limit):
                row = job()
        except Exception as e:  # noqa: BLE001 - one failed variant must not lose the others
            row = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps(row), flush=True)
        rows.append(row)
        Path(a.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
