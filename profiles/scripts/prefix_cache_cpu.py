"""Prefix caching on a multi-turn workload built from MT-bench (CPU, fp32, SmolLM2 + shipped head).

Turn 1: the first questions, answered by the engine (greedy). Turn 2: the conversation so far
(question 1, the engine's answer, question 2) through the chat template, so each second-turn
prompt resends the first turn. Reported per configuration: prefill tokens computed, prompt
tokens served from the cache, and the second turn's mean time to first token.

python profiles/scripts/prefix_cache_cpu.py --num 10 --max-tokens 64 > profiles/results/2026-11-30_cpu_prefix-cache/prefix_cache_cpu.txt
"""
from __future__ import annotations

import argparse
import json
import statistics

from compiled_spec import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="../shared/data/mt_bench/question.jsonl")
    ap.add_argument("--num", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(a.prompts)][:a.num]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    configs = [("vanilla", {}, False, None), ("vanilla", {}, True, None),
               ("EAGLE-3 k=3", dict(draft="smollm2-eagle3", num_speculative_tokens=3), False,
                None),
               ("EAGLE-3 k=3", dict(draft="smollm2-eagle3", num_speculative_tokens=3), True,
                "successor"),
               ("EAGLE-3 k=3", dict(draft="smollm2-eagle3", num_speculative_tokens=3), True,
                "recompute")]
    for name, kw, caching, mode in configs:
        llm = LLM(dtype="float32", device="cpu", max_model_len=2048, max_num_seqs=a.num,
                  enable_prefix_caching=caching, **({"prefix_caching_mode": mode} if mode else {}),
                  **kw)
        first = [llm.encode_chat([{"role": "user", "content": r["turns"][0]}]) for r in rows]
        ans = llm.generate(first, sp)
        pre1, cached1 = llm.stats.num_prefill_tokens, llm.stats.num_cached_tokens
        second = [llm.encode_chat([{"role": "user", "content": r["turns"][0]},
                                   {"role": "assistant", "content": o.text},
                                   {"role": "user", "content": r["turns"][1]}])
                  for r, o in zip(rows, ans)]
        outs = llm.generate(second, sp)
        ttft = [o.metrics.time_to_first_token for o in outs]
        print(json.dumps({
            "engine": name, "prefix_caching": caching, "mode": mode,
            "turn2_prompt_tokens": sum(len(p) for p in second),
            "turn2_prefill_tokens_computed": llm.stats.num_prefill_tokens - pre1,
            "turn2_tokens_from_cache": llm.stats.num_cached_tokens - cached1,
            "turn2_mean_ttft_s": round(statistics.mean(ttft), 4),
            "tau": llm.stats.spec.mean_acceptance_length}), flush=True)


if __name__ == "__main__":
    main()
