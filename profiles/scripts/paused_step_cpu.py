"""Issue 16: what a paused step of an EAGLE-3 engine costs against a vanilla decode step (CPU,
fp32, eager, SmolLM2 + the shipped head, 8 MT-bench prompts at batch 8).

    python profiles/scripts/paused_step_cpu.py [--order vanilla,paused,spec]

"paused": speculation_policy="adaptive" with every step PLAIN (the draft's first pass only),
"spec": every step drafting k=5. Prints tokens/s, the mean decode step and the host phases
over 0.5 ms per decode step (engine/host_clock.py), and the first tokens of two outputs (the
same in every engine: greedy, lossless).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.bench.prompts import load_mt_bench  # noqa: E402
from compiled_spec.models.gguf_loader import find_default_gguf  # noqa: E402
from compiled_spec.spec.policy import PLAIN, SPEC  # noqa: E402
from tests.policy_stub import ModesInTurn  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="../shared/data/mt_bench/question.jsonl")
    ap.add_argument("--order", default="vanilla,paused,spec")
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    torch.set_num_threads(2)
    texts = load_mt_bench(a.prompts, 8)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    spec = dict(draft="smollm2-eagle3", num_speculative_tokens=5, speculation_policy="adaptive")
    engines = {"vanilla": ({}, None), "paused": (spec, PLAIN), "spec": (spec, SPEC)}
    for name in a.order.split(","):
        kw, mode = engines[name]
        llm = LLM(model=find_default_gguf(), dtype="float32", device="cpu", max_model_len=1024,
                  max_num_seqs=8, **kw)
        llm.generate(texts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        if mode is not None:
            llm.engine.stats.policy = ModesInTurn([mode])  # this mode every step
        es = llm.engine.stats
        hp0, n0, s0 = dict(es.host_phase_s), es.num_steps, es.step_s
        p0, ps0 = es.num_prefill_steps, es.prefill_step_s
        t = time.perf_counter()
        outs = llm.generate(texts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        nd = es.num_steps - n0 - (es.num_prefill_steps - p0)  # decode steps
        print(name, json.dumps({
            "tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / wall, 1),
            "decode_step_ms": round(1e3 * (es.step_s - s0 - (es.prefill_step_s - ps0)) / nd, 1),
            "phases_ms": {k: round(1e3 * (v - hp0.get(k, 0.0)) / nd, 1)
                          for k, v in es.host_phase_s.items()
                          if 1e3 * (v - hp0.get(k, 0.0)) / nd > 0.5},
            "first_tokens": [o.outputs[0].token_ids[:8] for o in outs[:2]]}), flush=True)


if __name__ == "__main__":
    main()
