"""Issue 7 on the H200: chain vs draft trees, compiled + CUDA graphs, batch 1, greedy.

python profiles/scripts/trees_h200.py --model ~/m/model.gguf --prompts .device/data/question.jsonl \
    --num-prompts 5 --max-tokens 128 --out trees.json

SmolLM2-135M-Instruct with the shipped head, MT-bench first turns through the chat template. Per
configuration: start-up (load + compile + capture), ms per output token, tokens/s, tau, the
acceptance rate per depth, whether the output equals the chain's, and the graph stats (every
step that ran without a graph is listed by reason).
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
from compiled_spec.bench import load_mt_bench, mt_bench_prompts  # noqa: E402
from compiled_spec.compile import CompileConfig  # noqa: E402

CONFIGS = {  # name -> (page_size, speculative kwargs)
    "chain_k5": (16, dict(num_speculative_tokens=5)),
    "tree_topk8_steps5_32": (16, dict(num_speculative_tokens=5, speculative_topk=8,
                                      speculative_num_draft_tokens=32)),
    "tree_topk4_steps5_16": (16, dict(num_speculative_tokens=5, speculative_topk=4,
                                      speculative_num_draft_tokens=16)),
    "tree_topk8_steps5_32_page1": (1, dict(num_speculative_tokens=5, speculative_topk=8,
                                           speculative_num_draft_tokens=32)),
}


def run(model: str, name: str, prompts: list, max_tokens: int) -> tuple[dict, list]:
    page, spec = CONFIGS[name]
    t0 = time.perf_counter()
    llm = LLM(model=model, draft="smollm2-eagle3", device="cuda", dtype="bfloat16",
              max_model_len=2048, max_num_seqs=1, kv_cache_memory_gib=4, page_size=page,
              compile=True, compile_config=CompileConfig(capture_batch_sizes=(1,)),
              speculation_policy="always", **spec)
    startup = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    s0 = llm.stats.spec.as_dict()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    toks = sum(len(o) for o in outs)
    s1 = llm.stats.spec.as_dict()
    steps = s1["num_drafting_steps"] - s0["num_drafting_steps"]
    acc = s1["num_accepted_tokens"] - s0["num_accepted_tokens"]
    row = {"page_size": page, **spec, "startup_s": round(startup, 1),
           "ms_per_token": round(dt / toks * 1e3, 4), "tokens_per_s": round(toks / dt, 1),
           "tau": round(1 + acc / max(steps, 1), 4), "drafting_steps": steps,
           "acceptance_per_depth": s1.get("acceptance_rate_per_position"),
           "graphs": llm.compile_stats["cuda_graphs"]}
    llm.shutdown()
    return row, outs


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--num-prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    tok_llm = LLM(model=a.model, device="cpu", max_model_len=64)  # chat template only
    prompts = mt_bench_prompts(tok_llm, load_mt_bench(a.prompts, a.num_prompts))
    del tok_llm
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "date": time.strftime("%Y-%m-%d"), "prompts": a.num_prompts,
                    "max_tokens": a.max_tokens, "rows": {}}
    ref = None
    for name in a.configs:
        row, outs = run(a.model, name, prompts, a.max_tokens)
        ref = outs if ref is None else ref
        row["same_output_as_first"] = sum(x == y for x, y in zip(outs, ref)) / len(ref)
        report["rows"][name] = row
        print(name, {k: v for k, v in row.items() if k != "graphs"}, flush=True)
        print("   without graph:", row["graphs"].get("without_graph"), flush=True)
        Path(a.out).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
