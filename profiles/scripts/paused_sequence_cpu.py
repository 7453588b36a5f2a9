"""Issue 16: what an adaptive EAGLE-3 engine's paused steps at batch 64 did, step by step, under
the two GPU scripts' sequences, on the CPU (emulated graphs, the engine's own code).

In the fifty-seventh session's H100 call, ``graph_launch_cost_gpu.py`` timed the paused
engine's decode steps at batch 64 at 0.850 ms (p50) against vanilla's 0.845, while
``greedy_vs_sampled_gpu.py`` timed the same engine's greedy steps at 1.18-1.29 ms against
vanilla's 0.862. The GPU decides the time; the engine's choices do not depend on it except
through the policy's measured costs. This replays each script's sequence here and counts what
the engine did in the timed generations: decode steps launched ahead and taken, skipped or
discarded (why), drafting steps (the policy's probes), deferred rows and flushes, and the host
phases per decode step (engine/host_clock.py; the emulated replays' CPU compute inside them).

- ``launch``: graphs of batch 64 only; one greedy generation of 8 tokens, then the timed one.
- ``gvs``: graphs of batches 1 and 64; at batch 1 a 16-token greedy and a sampled warm-up and
  ROUNDS x (greedy, sampled), then the same at batch 64 (timed: the batch-64 generations).
- ``gvs_greedy``: as ``gvs`` without the sampled generations.

    .venv/bin/python profiles/scripts/paused_sequence_cpu.py [--modes launch gvs gvs_greedy]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from profiles.scripts.prompt_step_host_cpu import _engine, tiny_pair  # noqa: E402


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1, 511) for _ in range(rng.randint(8, 24))] for _ in range(n)]


def _snap(llm: LLM) -> dict[str, Any]:
    es = llm.stats
    return {"steps": len(es.recent_decode_step_s), "phase_ms": {
                k: 1e3 * v for k, v in es.host_phase_s.items()}, "va": es.verify_ahead.as_dict(),
            "early": es.early_propose.as_dict(), "deferred": es.deferred_first_pass.as_dict()}


def _diff(a: Any, b: Any) -> Any:
    """b - a, recursively over dicts of numbers (keys only in b count from 0)."""
    if isinstance(b, dict):
        return {k: d for k in b if (d := _diff(a.get(k, 0) if isinstance(a, dict) else 0,
                                             b[k])) not in (0, {}, [])}
    if isinstance(b, (int, float)) and not isinstance(b, bool):
        return round(b - a, 3) if isinstance(b, float) else b - a
    return b


def _per_step(d: dict[str, Any]) -> dict[str, Any]:
    """The host phases as ms per decode step (the emulated replays' compute inside them)."""
    n = max(d.get("steps", 1), 1)
    d["phase_ms"] = {k: round(v / n, 3) for k, v in d.get("phase_ms", {}).items()}
    return d


def _gen(llm: LLM, n: int, temperature: float, max_tokens: int) -> None:
    sps = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i,
                          ignore_eos=True) for i in range(n)]
    llm.generate(_prompts(n), sps, use_tqdm=False)


def run(mode: str, target: str, head: str, tok: str, batch: int, rounds: int,
        max_tokens: int) -> dict[str, Any]:
    temps = (0.0,) if mode != "gvs" else (0.0, 0.8)
    sizes = (batch,) if mode == "launch" else (1, batch)
    llm = _engine("eagle", target, head, tok, batch, "adaptive", sizes)
    llm.stats.recent_decode_step_s.clear()
    timed = []
    if mode == "launch":
        _gen(llm, batch, 0.0, 8)
        s0 = _snap(llm)
        _gen(llm, batch, 0.0, max_tokens)
        timed.append(("greedy", _per_step(_diff(s0, _snap(llm)))))
    else:
        for b in (1, batch):
            for t in temps:
                _gen(llm, b, t, 16)
            for _ in range(rounds):
                for t in temps:
                    s0 = _snap(llm)
                    _gen(llm, b, t, max_tokens)
                    if b == batch:
                        timed.append(("greedy" if t == 0 else "sampled", _per_step(
                            _diff(s0, _snap(llm)))))
    pol = llm.stats.policy.summary() if llm.stats.policy is not None else {}
    return {"mode": mode, "timed": timed, "policy": pol}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["launch", "gvs", "gvs_greedy"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(1)
    target, head, tok = tiny_pair()
    for mode in a.modes:
        print(json.dumps(run(mode, target, head, tok, a.batch, a.rounds, a.max_tokens)),
              flush=True)


if __name__ == "__main__":
    main()
