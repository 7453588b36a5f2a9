"""The engine's host cost per step at large batch (self-distillation data generation), on the CPU.

On the H200, vanilla decoding at batch ~600-1024 (decode steps replayed as CUDA graphs) cost
32.6 ms per engine step while the 135M model's GPU work at that batch is ~3-5 ms: the rest is
host work that grows with the number of running requests (scheduling, the flat batch and block
tables, staging, acceptance, stop checks, output bookkeeping). The host side runs the same code
on any device, so it is measured here with a tiny target (vocab 512, hidden 32, 2 layers) whose
paged attention is replaced by zeros (the CPU reference would dominate otherwise) and whose
remaining forward time, and sampling's tensor math, is timed and subtracted ("host ms"; "step
host": the same inside engine.step only, without request validation and output building).

Workload: 2*B random prompts (20-100 tokens), max_tokens 8-128, half greedy and half at
temperature 0.8 with seeds, ignore_eos; LLM(max_num_seqs=B, max_num_batched_tokens=16*B,
kv_cache_memory_gib=1.0). ``--emulate-graphs``: compiled (our passes, no Inductor) and routed
through emulated CUDA graphs (``capture.emulate``), so decode steps take the graph-staging path
(``run_host``) as on the GPU. The "tokens" column is a digest of every output token: it must not
change when the host code is optimised. "prefill": steps with prompt tokens (on the GPU those run
without a graph).

.venv/bin/python profiles/scripts/host_large_batch_cpu.py [--batch 256 1024] [--emulate-graphs]
                                                          [--cprofile] [--seed 0]
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kernels.ops  # noqa: E402
from capture import CapturePolicy  # noqa: E402
from capture.emulate import EmulatedGraph  # noqa: E402
from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.compile import CompileConfig, capture_graphs, compile_models  # noqa: E402
from compiled_spec.engine import sampled_accept  # noqa: E402

# Model compute is not the subject: attention returns zeros (the op's CPU body looks the
# reference up at call time), and what forward time remains is timed and subtracted.
kernels.ops.paged_attention_ref = lambda q, *a: torch.zeros_like(q)
_MODEL_S = [0.0]
_orig_replay = EmulatedGraph.replay


def _timed_replay(self: EmulatedGraph) -> None:
    t0 = time.perf_counter()
    try:
        _orig_replay(self)
    finally:
        _MODEL_S[0] += time.perf_counter() - t0


EmulatedGraph.replay = _timed_replay  # type: ignore[method-assign]


def _timed(fn):
    def call(*args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            _MODEL_S[0] += time.perf_counter() - t0
    return call


# Sampling's tensor math (filters, the k = 0 rejection sample) is a few kernels on the GPU but real
# compute here: timed as model work too. Building its inputs on the host stays host time.
sampled_accept.apply_filters = _timed(sampled_accept.apply_filters)
sampled_accept.rejection_sample = _timed(sampled_accept.rejection_sample)


def tokenizer_dir() -> str:
    tok = ROOT / ".device" / "tok"
    if not (tok / "tokenizer.json").is_file():  # as profiles/scripts/prepare_device.sh
        from compiled_spec.models.gguf_loader import find_default_gguf
        from compiled_spec.tokenizer import load_tokenizer

        load_tokenizer(find_default_gguf()).save_pretrained(str(tok))
    return str(tok)


def workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, vocab - 1) for _ in range(rng.randint(20, 100))]
               for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(8, 128), ignore_eos=True,
                             **({"temperature": 0.0} if i % 2 == 0 else
                                {"temperature": 0.8, "seed": rng.randrange(1 << 30)}))
              for i in range(n)]
    return prompts, params


def measure(target: str, tok: str, batch: int, graphs: bool, seed: int,
            prof: cProfile.Profile | None) -> dict:
    llm = LLM(model=target, tokenizer=tok, dtype="float32", max_model_len=256,
              max_num_seqs=batch, max_num_batched_tokens=16 * batch, kv_cache_memory_gib=1.0)
    runner = llm.engine.runner
    if graphs:
        models = compile_models(runner, CompileConfig(inductor=False))
        llm._compiled = models
        sizes = tuple(s for s in (1, 8, 32, 128, 256, 512) if s < batch) + (batch,)
        policy = CapturePolicy(max_batch_size=batch, num_speculative_tokens=0,
                               max_model_len=256, batch_sizes=sizes, seq_len_buckets=(256,))
        capture_graphs(runner, models, policy, llm.config.cache.page_size, emulate=True)
        llm.generate(*workload(batch, 512, seed + 1))  # warm: Dynamo guards and recompiles
    if graphs:  # prefills run the compiled fn; decode steps replay (timed above)
        runner.target_fn.fn = _timed(runner.target_fn.fn)
    else:
        runner.target_fn = _timed(runner.target_fn)
    eng = llm.engine
    step, step_s = eng.step, [0.0]

    def timed_step():
        t0 = time.perf_counter()
        try:
            return step()
        finally:
            step_s[0] += time.perf_counter() - t0

    eng.step = timed_step  # type: ignore[method-assign]
    execute, mixed = runner.execute, [0]

    def counted_execute(reqs, num_new):  # steps with prompt tokens: no graph on the GPU
        mixed[0] += max(num_new) > 1
        return execute(reqs, num_new)

    runner.execute = counted_execute  # type: ignore[method-assign]
    prompts, params = workload(2 * batch, 512, seed)
    steps0, _MODEL_S[0] = eng.stats.num_steps, 0.0
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    steps = eng.stats.num_steps - steps0
    digest = hashlib.sha1(repr([o.outputs[0].token_ids for o in outs]).encode()).hexdigest()
    return {"B": batch, "mode": "graphs" if graphs else "eager", "steps": steps,
            "ms_per_step": 1e3 * wall / steps, "host_ms_per_step": 1e3 * (wall - _MODEL_S[0]) / steps,
            "step_host_ms": 1e3 * (step_s[0] - _MODEL_S[0]) / steps,
            "prefill_steps": mixed[0], "preemptions": eng.stats.num_preemptions,
            "tokens": digest[:12]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--emulate-graphs", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="top functions by tottime")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", default=None, help="an HF dir (default: built in a temp dir)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    tok = tokenizer_dir()
    tmp = tempfile.TemporaryDirectory()
    target = a.target
    if target is None:
        from tests.spec_models import write_bigram_target

        target = write_bigram_target(Path(tmp.name) / "target", vocab=512, hidden=32, layers=2)
    rows = []
    for b in a.batch:
        prof = cProfile.Profile() if a.cprofile else None
        rows.append(measure(target, tok, b, a.emulate_graphs, a.seed, prof))
        print(rows[-1], flush=True)
        if prof is not None:
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    print(f"\n{'B':>5} {'mode':>6} {'ms/step':>8} {'host ms':>8} {'step host':>9} {'steps':>6} "
          f"{'prefill':>7} tokens")
    for r in rows:
        print(f"{r['B']:>5} {r['mode']:>6} {r['ms_per_step']:>8.2f} {r['host_ms_per_step']:>8.2f} "
              f"{r['step_host_ms']:>9.2f} {r['steps']:>6} {r['prefill_steps']:>7} {r['tokens']}")


if __name__ == "__main__":
    main()
