"""Early tree propose on a GPU (issue 15): the early graph captures under CUDA, greedy tree output
equals vanilla decoding and the late path's, with the same acceptance, and the step time of each.

python profiles/scripts/early_tree_gpu_check.py [--fixtures .device/tc] [--tokenizer .device/tok]
    [--tokens 96] [--batch 1 4] [--inductor]

The tiny bigram target + EAGLE-3 head of tests/conftest.py (host_overhead_cpu.py builds them):
its GPU work is tiny, so a step's time is mostly host work and launches, which is what early
propose hides. One engine per tree shape, captured once; the switch flips early on and off.
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
from compiled_spec.compile import CompileConfig  # noqa: E402

TREES = {"tree_topk8_32": dict(speculative_topk=8, speculative_num_draft_tokens=32),
         "tree_topk4_16": dict(speculative_topk=4, speculative_num_draft_tokens=16)}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _gen(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> tuple[list, float]:
    _sync()
    t0 = time.perf_counter()
    out = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    _sync()
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=".device/tc")
    ap.add_argument("--tokenizer", default=".device/tok")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--inductor", action="store_true")
    ap.add_argument("--device", default="cuda")  # cpu: a smoke run of this script (no graphs)
    a = ap.parse_args()
    fx = Path(a.fixtures)
    common = dict(model=str(fx / "target"), tokenizer=a.tokenizer, device=a.device,
                  max_model_len=256, max_num_seqs=max(a.batch), page_size=16)
    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    vanilla = LLM(**common)
    rows = []
    for name, tree in TREES.items():
        t0 = time.perf_counter()
        llm = LLM(**common, draft=str(fx / "head"), num_speculative_tokens=5, **tree,
                  compile=True, compile_config=CompileConfig(
                      inductor=a.inductor, capture_batch_sizes=tuple(a.batch),
                      strict_capture=True))
        startup = time.perf_counter() - t0
        runner = llm.engine.runner
        for b in a.batch:
            prompts = [[3, 7, 1, 9, 2, 4][: 3 + i % 3] + [i % 29 + 1] for i in range(b)]
            ref, _ = _gen(vanilla, prompts, sp)
            res = {}
            for early in (False, True, False, True):  # warm both, then time the second pair
                runner.early.enabled = early
                st0, acc0 = llm.stats.early_propose.as_dict(), llm.stats.spec.num_accepted_tokens
                steps0 = llm.stats.spec.num_drafting_steps
                out, dt = _gen(llm, prompts, sp)
                st1 = llm.stats.early_propose.as_dict()
                steps = llm.stats.spec.num_drafting_steps - steps0
                res["early" if early else "late"] = {
                    "equal_vanilla": out == ref, "s": round(dt, 4),
                    "tokens_per_s": round(sum(map(len, out)) / dt, 1),
                    "ms_per_drafting_step": round(dt / max(steps, 1) * 1e3, 4),
                    "accepted": llm.stats.spec.num_accepted_tokens - acc0,
                    "early_steps": st1["early"] - st0["early"],
                    "late_reasons": {k: v - st0["late_reasons"].get(k, 0)
                                     for k, v in st1["late_reasons"].items()}}
            row = {"variant": name, "batch": b, "startup_s": round(startup, 1), **res}
            print(json.dumps(row), flush=True)
            rows.append(row)
        comps = llm.compile_stats["cuda_graphs"].get("components", {})
        print(json.dumps({"variant": name, "graphs": {
            n: {k: c[k] for k in ("graph_replays", "captured_sizes", "capture_failures")}
            for n, c in comps.items()}, "compiles": {
            n: v["graphs"] for n, v in llm.compile_stats.items()
            if isinstance(v, dict) and "graphs" in v}}), flush=True)
        llm.shutdown()
    print(json.dumps({"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else
                      None, "torch": torch.__version__,
                      "date": time.strftime("%Y-%m-%d")}))
    ok = all(r[m]["equal_vanilla"] for r in rows for m in ("early", "late")) and all(
        r["early"]["accepted"] == r["late"]["accepted"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
