"""How bulk admission (``min_admit``) changes the steps of offline generation, on the CPU.

On the H200 (results/2026-12-01_h200_session5/), self-distillation at batch 1,024 spent 145 s of
a 208 s chunk in 3,298 steps that admitted prompts (44.1 ms each: no CUDA graph, host-bound
whatever the prompt count) against 13.3 ms per decode-only step (a graph replay). The step
counts depend only on the scheduler, so they are counted here with a tiny target whose attention
returns zeros (model compute is not the subject), and the GPU time is estimated as
prefill steps x 44.1 ms + decode-only steps x 13.3 ms (an estimate from those two measured
costs, not a measurement).

Workload: N = 4 x batch requests with token prompts of 200-1,500 tokens (later turns of a
conversation) and replies of 16-512 tokens (max_tokens, ignore_eos), greedy; one generate call,
as one round of a self-distillation chunk.

.venv/bin/python profiles/scripts/admission_cpu.py [--batch 256] [--min-admit 1 8 16 32]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import kernels.ops  # noqa: E402
from compiled_spec import LLM, SamplingParams  # noqa: E402

kernels.ops.paged_attention_ref = lambda q, *a: torch.zeros_like(q)
PREFILL_MS, DECODE_MS = 44.1, 13.3  # H200, batch 1,024 (see the docstring)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--min-admit", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    from profiles.scripts.host_large_batch_cpu import tokenizer_dir
    from tests.spec_models import write_bigram_target

    rng = random.Random(a.seed)
    n = 4 * a.batch
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(200, 1500))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(16, 512), temperature=0.0, ignore_eos=True)
              for _ in range(n)]
    with tempfile.TemporaryDirectory() as tmp:
        target = write_bigram_target(Path(tmp) / "target", vocab=512, hidden=32, layers=2)
        cfg_file = Path(target) / "config.json"  # room for the long prompts
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()),
                                        "max_position_embeddings": 2048}))
        tok = tokenizer_dir()
        print(f"batch {a.batch}, {n} requests, prompts 200-1500 tokens, replies 16-512 tokens")
        print(f"{'min_admit':>9s} {'steps':>6s} {'prefill':>8s} {'decode':>7s} {'mean batch':>10s} "
              f"{'est. H200 s':>11s} {'cpu s':>6s}")
        for m in a.min_admit:
            llm = LLM(model=target, tokenizer=tok, dtype="float32", max_model_len=2048, max_num_seqs=a.batch,
                      max_num_batched_tokens=32 * a.batch, min_admit=m, kv_cache_memory_gib=2.0)
            batch_sum = [0]
            orig = llm.engine.runner.execute

            def spy(reqs, num_new, orig=orig):
                batch_sum[0] += len(reqs)
                return orig(reqs, num_new)

            llm.engine.runner.execute = spy
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            secs = time.perf_counter() - t0
            st = llm.stats
            dec = st.num_steps - st.num_prefill_steps
            est = (st.num_prefill_steps * PREFILL_MS + dec * DECODE_MS) / 1e3
            print(f"{m:9d} {st.num_steps:6d} {st.num_prefill_steps:8d} {dec:7d} "
                  f"{batch_sum[0] / st.num_steps:10.1f} {est:11.1f} {secs:6.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
