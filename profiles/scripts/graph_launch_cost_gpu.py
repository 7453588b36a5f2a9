"""Issue 16: the host cost of one replay of each engine's target decode graph, untraced.

The fifty-fifth session's trace of paused steps at batch 64 (results/2026-12-07_h100_session55/)
put the same GPU work in a paused EAGLE-3 step as in a vanilla one (215 against 214 kernels),
but ~80 us more host time in ``cudaGraphLaunch`` of its decode graph (444 against 363 us under
the profiler). This times ``replay()`` of the 64-row decode graph itself, GPU idle before each
call (synchronized), so the figure is the launch's host time alone, for engines that differ in
one thing at a time:
- ``vanilla``: PDL on every call (its widest call is 64 rows);
- ``adaptive``: EAGLE-3 k = 5, its target compiled twice (``target_pdl`` for <= 64 rows);
- ``adaptive_nonarrow``: the same with ``pdl_narrow=False`` (one compile, no PDL anywhere);
- ``vanilla_nopdl``: vanilla with ``pdl=False``.
Then each engine's decode steps of one greedy generation (64 tokens per request), untraced:
step p50 and host phases per step, beside the launch figures.
Random SmolLM2-shaped weights; each engine's row prints as soon as it is measured.

  python3 profiles/scripts/graph_launch_cost_gpu.py --tokenizer ~/tok [--variants ...] [--cprofile]
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


def _engine(variant: str, model: str, head: str, tok: str, batch: int, device: str) -> Any:
    from compiled_spec import LLM
    from compiled_spec.compile import CompileConfig

    cc: dict[str, Any] = dict(capture_batch_sizes=(batch,))
    if variant == "adaptive_nonarrow":
        cc["pdl_narrow"] = False
    if variant == "vanilla_nopdl":
        cc["pdl"] = False
    kw: dict[str, Any] = dict(model=model, tokenizer=tok, dtype="bfloat16", device=device,
                              max_num_seqs=batch, compile=True,
                              compile_config=CompileConfig(**cc))
    if variant.startswith("adaptive"):
        kw.update(draft=head, num_speculative_tokens=5, speculation_policy="adaptive")
    return LLM(**kw)


def _launch_us(graph: Any, reps: int) -> dict[str, float]:
    """Host microseconds of ``graph.replay()`` with the GPU idle before each call."""
    import torch

    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        ts.append(1e6 * (time.perf_counter() - t0))
    torch.cuda.synchronize()
    ts.sort()
    return {"p50": round(statistics.median(ts), 1), "p10": round(ts[len(ts) // 10], 1),
            "p90": round(ts[9 * len(ts) // 10], 1)}


def _profiled(llm: Any, prompts: list[list[int]], sp: Any, name: str, top: int = 25) -> None:
    import cProfile
    import pstats

    es = llm.stats
    es.recent_decode_step_s.clear()
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, sp)
    prof.disable()
    n = max(len(es.recent_decode_step_s), 1)
    st = pstats.Stats(prof)
    rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own time
    print(f"== cProfile {name}: own / cumulative us per decode step ({n} steps)", flush=True)
    for (file, line, fn), (_, calls, own, cum, _) in rows:
        print(f"{1e6 * own / n:9.1f} {1e6 * cum / n:9.1f} {calls / n:7.2f}  "
              f"{Path(file).name}:{line}({fn})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cprofile", action="store_true",
                    help="then one more generation per engine under cProfile")
    ap.add_argument("--variants", nargs="+",
                    default=["vanilla", "adaptive", "adaptive_nonarrow", "vanilla_nopdl"])
    a = ap.parse_args()

    from compiled_spec import SamplingParams

    model, head = random_pair("graph_launch_")
    prompts = synthetic_prompts(a.batch)
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for v in a.variants:
        t0 = time.perf_counter()
        llm = _engine(v, model, head, a.tokenizer, a.batch, a.device)
        startup = time.perf_counter() - t0
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        # the target's decode GraphRunner (none on a CPU dry run)
        decode = getattr(llm.engine.runner.target_fn, "decode", None)
        rows = {}
        for key, (graph, _) in sorted(getattr(decode, "_graphs", {}).items()):
            rows[str(key)] = _launch_us(graph, a.reps)
        # The same engine's decode steps, untraced: host phases per step (engine/host_clock.py)
        es = llm.stats
        ph0 = dict(es.host_phase_s)
        es.recent_decode_step_s.clear()
        llm.generate(prompts, greedy)
        steps = list(es.recent_decode_step_s)
        phases = {p: round(1e3 * (s - ph0.get(p, 0.0)) / max(len(steps), 1), 3)
                  for p, s in es.host_phase_s.items() if s > ph0.get(p, 0.0)}
        pdl = llm.compile_stats.get("pdl", {})
        print(json.dumps({"variant": v, "startup_s": round(startup, 1),
                          "pdl": pdl.get("why") if isinstance(pdl, dict) else pdl,
                          "decode_graph_launch_us": rows,
                          "decode_steps": len(steps),
                          "step_p50_ms": round(1e3 * statistics.median(steps), 3) if steps else None,
                          "phases_ms_per_step": phases,  # probing steps' included
                          "policy": (llm.stats.policy.summary() if llm.stats.policy else None),
                          "deferred": (es.deferred_first_pass.as_dict()
                                       if es.deferred_first_pass is not None else None)}),
              flush=True)
        if a.cprofile:  # own time per decode step of the functions that take the most
            _profiled(llm, prompts, greedy, v)
        del llm
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
