"""Chain vs draft trees with the shipped SmolLM2 head: tau on MT-bench first turns (CPU, fp32).

python profiles/scripts/tree_tau_cpu.py --num-prompts 20 --max-tokens 128 > profiles/results/2026-11-30_cpu_tree-tau/tree_tau_cpu.txt
Acceptance does not depend on the device, up to bf16-vs-fp32 rounding; speed is measured on the
H200 only.
"""
from __future__ import annotations

import argparse
import json
import time

from compiled_spec import LLM, SamplingParams
from compiled_spec.bench.prompts import load_mt_bench, mt_bench_prompts

CONFIGS = [dict(num_speculative_tokens=5),
           dict(num_speculative_tokens=5, speculative_topk=4, speculative_num_draft_tokens=16),
           dict(num_speculative_tokens=5, speculative_topk=4, speculative_num_draft_tokens=32),
           dict(num_speculative_tokens=5, speculative_topk=8, speculative_num_draft_tokens=32),
           dict(num_speculative_tokens=5, speculative_topk=8, speculative_num_draft_tokens=64)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="../shared/data/mt_bench/question.jsonl")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16])
    a = ap.parse_args()
    texts = load_mt_bench(a.prompts, a.num_prompts)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    ref = None
    for page in a.page_sizes:
        for cfg in CONFIGS:
            llm = LLM(dtype="float32", device="cpu", max_model_len=2048, page_size=page,
                      max_num_seqs=a.num_prompts, draft="smollm2-eagle3", **cfg)
            prompts = mt_bench_prompts(llm, texts)
            t0 = time.perf_counter()
            outs = [o.token_ids for o in llm.generate(prompts, sp)]
            s = llm.stats.spec
            same = None if ref is None else sum(x == y for x, y in zip(outs, ref)) / len(ref)
            ref = ref or outs
            print(json.dumps({"page_size": page, **cfg, "tau": round(s.mean_acceptance_length, 4),
                              "drafting_steps": s.num_drafting_steps,
                              "per_position": [round(x, 3) for x in
                                               s.as_dict()["acceptance_rate_per_position"]],
                              "same_output_as_first": same,
                              "seconds": round(time.perf_counter() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
