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
      [--temps 0 0.8] [--capture 64] [--unseeded] [--max-tokens 128]

The fifty-seventh session's first call (H100) put the EAGLE-3 engine's greedy paused steps at
batch 64 at 1.18-1.29 ms (p50) here against vanilla's 0.862, while graph_launch_cost_gpu.py in
the same call had them level (0.850 against 0.845). The options take this script's differences
from that one away one at a time: ``--temps 0`` (no sampled generations between the greedy
ones), ``--capture 64`` (graphs of batch 64 only, where ``--batches 1 64`` also captures 1),
``--unseeded`` (greedy requests without a seed), ``--max-tokens 64``. ``--sample-compile``:
the sampled draws compiled before capture (``CompileConfig.sample_compile``). Each row also prints the
decode steps' p10 / p90 and mean, their host phases (engine/host_clock.py) and the deferred
first pass's stats.
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


def _engine(kind: str, model: str, head: str, tok: str, batches: list[int],
            capture: list[int], device: str, sample_compile: bool = False) -> Any:
    from compiled_spec import LLM
    from compiled_spec.compile import CompileConfig

    # Graphs of the timed batch sizes only: a cold start captures fewer sizes.
    kw: dict[str, Any] = dict(model=model, tokenizer=tok, dtype="bfloat16", device=device,
                              max_num_seqs=max(batches), compile=True,
                              compile_config=CompileConfig(capture_batch_sizes=tuple(capture),
                                                           sample_compile=sample_compile))
    if kind == "eagle3":
        kw.update(draft=head, num_speculative_tokens=5, speculation_policy="adaptive")
    return LLM(**kw)


def _timed(llm: Any, prompts: list[list[int]], temperature: float, max_tokens: int,
           seeded: bool = True) -> dict[str, Any]:
    from compiled_spec import SamplingParams

    sps = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          seed=i if seeded else None, ignore_eos=True)
           for i in range(len(prompts))]
    es = llm.stats
    es.recent_decode_step_s.clear()
    ph0 = dict(es.host_phase_s)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = sorted(es.recent_decode_step_s)
    if not steps:
        return {"tok_s": round(n / wall, 1), "step_p50_ms": None}
    ms = lambda x: round(1e3 * x, 3)  # noqa: E731
    return {"tok_s": round(n / wall, 1), "step_p50_ms": ms(statistics.median(steps)),
            "p10": ms(steps[len(steps) // 10]), "p90": ms(steps[9 * len(steps) // 10]),
            "mean": ms(statistics.fmean(steps)), "steps": len(steps),
            "phases": {p: round(1e3 * (s - ph0.get(p, 0.0)) / len(steps), 3)
                       for p, s in es.host_phase_s.items() if s > ph0.get(p, 0.0)}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--kinds", nargs="+", default=["vanilla", "eagle3"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--capture", type=int, nargs="+", default=None,
                    help="graph batch sizes (default: --batches)")
    ap.add_argument("--unseeded", action="store_true", help="requests without a seed")
    ap.add_argument("--sample-compile", action="store_true",
                    help="CompileConfig(sample_compile=True): the draws compiled, then captured")
    a = ap.parse_args()
    names = {0.0: "greedy"}

    model, head = random_pair("greedy_sampled_")
    for kind in a.kinds:
        t0 = time.perf_counter()
        llm = _engine(kind, model, head, a.tokenizer, a.batches, a.capture or a.batches,
                      a.device, a.sample_compile)
        startup = time.perf_counter() - t0
        for b in a.batches:
            prompts = synthetic_prompts(b)
            for t in a.temps:  # warm the paths at this batch (graphs of its size)
                _timed(llm, prompts, t, 16, not a.unseeded)
            rows: dict[str, list[Any]] = {names.get(t, "sampled"): [] for t in a.temps}
            for _ in range(a.rounds):
                for t in a.temps:
                    rows[names.get(t, "sampled")].append(
                        _timed(llm, prompts, t, a.max_tokens, not a.unseeded))
            g = llm.compile_stats.get("cuda_graphs", {}) if llm.compiled_active else {}
            out = {"kind": kind, "batch": b, "startup_s": round(startup, 1),
                   "capture": a.capture or a.batches, "seeded": not a.unseeded,
                   "sample_compile": a.sample_compile, **rows,
                   "steps_without_graph": g.get("without_graph", g.get("off")),
                   "sample_draw_replays": g.get("components", {}).get("sample_draw", {})
                   .get("graph_replays")}
            if llm.stats.policy is not None:
                from compiled_spec.spec.policy import bucket_of

                out["policy"] = llm.stats.policy.summary().get(bucket_of(b))
            d = llm.stats.deferred_first_pass
            if d is not None:
                out["deferred"] = d.as_dict()
            print(json.dumps(out), flush=True)
        del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
