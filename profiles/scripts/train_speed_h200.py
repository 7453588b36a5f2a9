"""Issue 14's throughput figures on a SmolLM2-135M-shaped target with random weights (no GGUF
needed): self-distillation tokens/s of our engine at large batch (eager vs compiled + CUDA
graphs), and EAGLE-3 training tokens/s with the target's features computed in the same step
(batch size, packed vs padded TTT step), with a per-phase split of one step, and a numerical
check of the packed step (flex attention, fused loss) against the padded reference.

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


def _setup(model: str, vocab: int, device: str, **cfg_kw):
    from compiled_spec.models.loader import load_model
    from compiled_spec.train.features import TargetFeaturizer
    from compiled_spec.train.step import TTTStep
    from compiled_spec.train.trainer import TrainConfig, build_head

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, _ = load_model(model, dtype, dev)
    cfg = TrainConfig(target=model, prompts="x", out="/tmp/x", draft_vocab_size=vocab,
                      max_seq_len=2048, **cfg_kw)
    g = torch.Generator().manual_seed(0)
    draft_ids = torch.randperm(49152, generator=g)[:vocab].sort().values
    draft = build_head(target, cfg, draft_ids)
    draft.lm_head.weight.requires_grad_(False)
    feats = TargetFeaturizer(target, draft.aux_layer_ids, draft_ids,
                             compiled=cfg.compile_features)
    return target, draft, TTTStep(feats, cfg), cfg


def _seqs(lengths: list[int]):
    from compiled_spec.train.data import TrainSequence

    rng = random.Random(1)
    return [TrainSequence(str(i), [rng.randrange(49152) for _ in range(n)], min(40, n // 2),
                          kind="prose") for i, n in enumerate(lengths)]


def train_section(model: str, batch_tokens: int, vocab: int, ttt_steps: int, steps: int,
                  impl: str, device: str, lengths: list[int],
                  profile_to: str | None = None, compile_features: bool = False,
                  compile_ttt: bool = False) -> dict:
    """Training tokens/s of the trainer's own step (``TTTStep``) with the target's features
    computed in it, split into the phases of a step."""
    from compiled_spec.train.data import Batches

    dev = torch.device(device)
    target, draft, ttt, cfg = _setup(model, vocab, device, ttt_steps=ttt_steps,
                                     batch_tokens=batch_tokens, ttt_impl=impl,
                                     compile_features=compile_features,
                                     compile_ttt=compile_ttt)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95))
    seqs = _seqs(lengths)
    batches = Batches(seqs, 8, batch_tokens, 0, ttt.budget if ttt.packed else None)
    phases = {"step": 0.0, "backward+opt": 0.0}
    tokens, t_start, done, warm_s = 0, None, 0, 0.0
    # Graphs Dynamo compiles while the steps are timed: > 0 means recompiles per batch (the
    # compiled feature forward ran at 7.9 s per step on the H200, 2026-12-01).
    from torch._dynamo.utils import counters
    graphs_at_start, step_ms = 0, []
    t_first = time.perf_counter()
    for k in range(steps + 2):
        if k == 2:  # two warm-up steps (allocator, autotuning, compile)
            sync()
            warm_s = time.perf_counter() - t_first
            t_start, tokens = time.perf_counter(), 0
            phases = dict.fromkeys(phases, 0.0)
            graphs_at_start = counters["stats"]["unique_graphs"]
        prof = None
        if profile_to and k == 3:  # one steady-state step: its kernels, by total GPU time
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else []))
            prof.__enter__()
        t0 = time.perf_counter()
        res, n = ttt(draft, batches.at(k))
        tokens += n
        sync(); t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        res.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sync(); t2 = time.perf_counter()
        if prof is not None:  # a profiler failure must not cost the section its figures
            try:
                prof.__exit__(None, None, None)
                key = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
                Path(profile_to).write_text(prof.key_averages().table(sort_by=key,
                                                                      row_limit=40))
            except Exception as e:  # noqa: BLE001
                Path(profile_to).write_text(f"profiler failed: {type(e).__name__}: {e}\n")
        phases["step"] += t1 - t0
        phases["backward+opt"] += t2 - t1
        step_ms.append(round(1000 * (t2 - t0), 1))
        done = k - 1
    dt = time.perf_counter() - t_start
    row = {"section": "train", "impl": impl, "budget": ttt.budget if ttt.packed else None,
           "compile_features": compile_features, "compile_ttt": compile_ttt, "step_ms": step_ms,
           "graphs_compiled_while_timed": counters["stats"]["unique_graphs"] - graphs_at_start,
           "batch_tokens": batch_tokens, "draft_vocab": vocab, "ttt_steps": ttt_steps,
           "steps": done, "tokens_per_s": round(tokens / dt), "warmup_s": round(warm_s, 1),
           "ms_per_step": {k: round(1000 * v / max(done, 1), 1) for k, v in phases.items()},
           "fill": round(tokens / done / ttt.budget, 3) if ttt.packed else None,
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1)
           if dev.type == "cuda" else None}
    del target, draft, opt, ttt
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
    return row


def check_section(model: str, vocab: int, device: str, lengths: list[int]) -> dict:
    """One batch through three implementations of the same loss: packed with flex attention
    and the compiled fused loss (the GPU default), packed with the dense mask, and the padded
    reference: losses and the relative difference of every gradient (bf16 autocast)."""
    from compiled_spec.train.data import pack_batches

    out = {"section": "check"}
    seqs = _seqs(lengths)
    plan = pack_batches([len(s.input_ids) for s in seqs], 4096, 0)
    batch = [seqs[i] for i in plan[0]]
    grads = {}
    for name, impl, flex in (("flex", "packed", True), ("dense", "packed", False),
                             ("padded", "padded", False)):
        _, draft, ttt, _ = _setup(model, vocab, device, ttt_steps=5, batch_tokens=4096,
                                  ttt_impl=impl)
        ttt.flex = flex
        res, _ = ttt(draft, batch)
        res.loss.backward()
        out[f"loss_{name}"] = round(res.loss.item(), 5)
        out[f"acc_{name}"] = [round(a, 4) for a in res.step_accuracy]
        grads[name] = {n: p.grad.float() for n, p in draft.named_parameters()
                       if p.grad is not None}
    for other in ("dense", "padded"):
        out[f"max_rel_grad_diff_flex_vs_{other}"] = round(max(
            ((grads["flex"][n] - g).norm() / g.norm().clamp(min=1e-12)).item()
            for n, g in grads[other].items()), 5)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sections", nargs="+", default=["gen", "check", "train"])
    ap.add_argument("--gen-batch", type=int, nargs="+", default=[512])
    ap.add_argument("--gen-prompts", type=int, default=1024)
    ap.add_argument("--gen-tokens", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[16384, 32768, 65536])
    ap.add_argument("--train-steps", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--limit", type=int, default=90, help="seconds per section")
    ap.add_argument("--impl", nargs="+", default=["packed"], choices=["packed", "padded"])
    ap.add_argument("--compile-features", action="store_true",
                    help="also time the first --batch-tokens with the compiled feature forward")
    ap.add_argument("--compile-ttt", action="store_true",
                    help="also time the first --batch-tokens with the compiled TTT step "
                    "(and the compiled feature forward), and profile it when --profile is given")
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="kernel table of one training step (first --batch-tokens value)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "config.json").write_text(json.dumps(SMOLLM2))
    model = f"random:{tmp}"
    rng = random.Random(2)
    # Lengths like multi-turn chat data: many short single turns, a long tail up to 2048.
    lengths = [min(2048, int(rng.lognormvariate(6.2, 0.7)) + 16) for _ in range(6000)]
    jobs = []
    if "gen" in a.sections:
        for b in a.gen_batch:
            for c in (False, True):
                jobs.append(lambda b=b, c=c: gen_section(model, a.tokenizer, b, c, a.gen_prompts,
                                                         a.gen_tokens, a.device))
    if "check" in a.sections:
        jobs.append(lambda: check_section(model, a.vocab, a.device, lengths))
    if "train" in a.sections:
        for impl in a.impl:
            for i, bt in enumerate(a.batch_tokens):
                jobs.append(lambda bt=bt, i=i, impl=impl: train_section(
                    model, bt, a.vocab, 5, a.train_steps, impl, a.device, lengths,
                    f"{a.profile}.{impl}" if a.profile and i == 0 else None))
            if a.compile_features:
                jobs.append(lambda impl=impl: train_section(
                    model, a.batch_tokens[0], a.vocab, 5, a.train_steps, impl, a.device,
                    lengths, compile_features=True))
            if a.compile_ttt and impl == "packed":
                jobs.append(lambda impl=impl: train_section(
                    model, a.batch_tokens[0], a.vocab, 5, a.train_steps, impl, a.device,
                    lengths, f"{a.profile}.compiled" if a.profile else None,
                    compile_features=True, compile_ttt=True))
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
