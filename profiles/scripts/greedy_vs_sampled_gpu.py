"""Issue 16: a greedy and a sampled generation timed by one engine, alternating, in one process.

The fifty-fifth session measured sampled draws replayed as a CUDA graph (vanilla batch 1: 2.54 ->
0.95 ms a step) but no greedy row beside them, so "sampled at greedy speed" stayed open: hosts
differ by ~1.5x between calls. Here each engine (vanilla; EAGLE-3 k = 5 with the adaptive policy)
one engine per kind, its graphs captured at the timed batch sizes,
runs the same prompts greedy (T = 0) and sampled (T = 0.8, seeded) in turns, so the two figures
share the host, the warm state and the graphs.
Random SmolLM2-shaped weights and a random head (acceptance ~1: the EAGLE rows time the policy's
paused steps, not a real head). Each row prints as soon as it is measured.

  python3 profiles/scripts/greedy_vs_sampled_gpu.py --tokenizer ~/tok [--batches 1 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from profiles.scripts.prompt_step_gpu import random_pair, synthetic_prompts  # noqa: E402


def _engine(kind: str, model: str, head: str, tok: str, batches: list[int], device: str
            ) -> Any:
    from compiled_spec import LLM
    from compiled_spec.compile import CompileConfig

    # Graphs of the timed batch sizes only: a cold start captures fewer sizes.
    kw: dict[str, Any] = dict(model=model, tokenizer=tok, dtype="bfloat16", device=device,
                              max_num_seqs=max(batches), compile=True,
                              compile_config=CompileConfig(capture_batch_sizes=tuple(batches)))
    if kind == "eagle3":
        kw.update(draft=head, num_speculative_tokens=5, speculation_policy="adaptive")
    return LLM(**kw)


def _timed(llm: Any, prompts: list[list[int]], temperature: float, max_tokens: int
           ) -> dict[str, Any]:
    from compiled_spec import SamplingParams

    sps = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                          ignore_eos=True) for i in range(len(prompts))]
    es = llm.stats
    es.recent_decode_step_s.clear()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = list(es.recent_decode_step_s)
    return {"tok_s": round(n / wall, 1),
            "step_p50_ms": round(1e3 * statistics.median(steps), 3) if steps else None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--kinds", nargs="+", default=["vanilla", "eagle3"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()

    model, head = random_pair("greedy_sampled_")
    for kind in a.kinds:
        t0 = time.perf_counter()
        llm = _engine(kind, model, head, a.tokenizer, a.batches, a.device)
        startup = time.perf_counter() - t0
        for b in a.batches:
            prompts = synthetic_prompts(b)
            for t in (0.0, 0.8):  # warm both paths at this batch (graphs of its size)
                _timed(llm, prompts, t, 16)
            rows: dict[str, list[Any]] = {"greedy": [], "sampled": []}
            for _ in range(a.rounds):
                for name, t in (("greedy", 0.0), ("sampled", 0.8)):
                    rows[name].append(_timed(llm, prompts, t, a.max_tokens))
            g = llm.compile_stats.get("cuda_graphs", {}) if llm.compiled_active else {}
            out = {"kind": kind, "batch": b, "startup_s": round(startup, 1), **rows,
                   "steps_without_graph": g.get("without_graph", g.get("off")),
                   "sample_draw_replays": g.get("components", {}).get("sample_draw", {})
                   .get("graph_replays")}
            if llm.stats.policy is not None:
                from compiled_spec.spec.policy import bucket_of

                out["policy"] = llm.stats.policy.summary().get(bucket_of(b))
            print(json.dumps(out), flush=True)
        del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
