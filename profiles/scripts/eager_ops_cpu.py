"""Issue 16: how many eager ops a decode step runs outside its graph replays, on the CPU.

On the GPU every such op is at least one launch (a few us of host time each, ~5-10 with
PyTorch's dispatch), so their count per step is a host cost that the CPU can measure where no
GPU is lent. The harness is ``paused_host_cpu.py``'s: a tiny target (vocab 512, attention
returning zeros) and a random EAGLE-3 head, compiled over our passes and replayed through
emulated CUDA graphs captured by the engine's own policy. Each emulated replay is wrapped in a
profiler annotation; the count is of the outermost aten ops (those not called by another aten
op) outside those annotations, per decode step; "kernel_ops_per_step" leaves out the ops that
only make a view (``NO_KERNEL``), the launches on a GPU.

Variants: "vanilla"; "paused" (speculation_policy="adaptive" held at PLAIN); "drafting"
(every step an early chain step). ``--sampled``: temperature 0.8 / top-p 0.9 with a seed, each
engine once with the sampled draws replayed (engine/sample_graph.py, the default) and once
eager. The token digest of every row of one mode must agree (greedy: vanilla's; sampled: the
coupling rule draws vanilla's tokens, drafts or not).

Fifty-fifth session, batch 64 (results/2026-12-07_cpu_session55/): see its README.

.venv/bin/python profiles/scripts/eager_ops_cpu.py [--batch 64] [--sampled] [--variants ...]
"""
from __future__ import annotations

import bisect
import hashlib
import json
import random
import sys
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import capture.emulate as emulate  # noqa: E402
from compiled_spec import SamplingParams  # noqa: E402
from compiled_spec.spec.policy import PLAIN  # noqa: E402
from profiles.scripts.prompt_step_host_cpu import _engine, host_args, tiny_pair  # noqa: E402
from tests.policy_stub import ModesInTurn  # noqa: E402

REPLAY = "emulated_replay"
# Ops that only make a view or a flag on the host (no kernel on the GPU), counted apart: they
# still pay the dispatcher's host time, a launch's less
NO_KERNEL = {f"aten::{n}" for n in (
    "view", "slice", "alias", "select", "reshape", "unsqueeze", "squeeze", "expand", "t",
    "transpose", "permute", "detach", "resolve_conj", "resolve_neg", "lift_fresh", "_unsafe_view",
    "as_strided", "flatten", "unflatten", "split", "chunk", "narrow", "unbind")}


def _annotate_replays() -> None:
    real = emulate.EmulatedGraph.replay

    def replay(self: emulate.EmulatedGraph) -> None:
        with torch.profiler.record_function(REPLAY):
            real(self)

    emulate.EmulatedGraph.replay = replay


def _outside_replays(events: list) -> tuple[Counter, int]:
    """(outermost aten ops outside the replays by name, decode + prompt steps: ``verify``
    annotations)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == REPLAY)
    starts = [a for a, _ in spans]

    def inside(t: float) -> bool:
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and spans[i][1] >= t

    ops = Counter(e.name for e in events if e.name.startswith("aten::")
                  and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
                  and not inside(e.time_range.start))
    return ops, sum(1 for e in events if e.name == "verify")


def _row(llm, prompts: list[list[int]], sp: SamplingParams) -> dict:
    llm.generate(prompts, sp, use_tqdm=False)  # warm: Dynamo guards, first replays
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    ops, steps = _outside_replays(list(prof.events()))
    kernels = sum(v for k, v in ops.items() if k not in NO_KERNEL)
    return {"steps": steps, "ops_per_step": round(sum(ops.values()) / steps, 1),
            "kernel_ops_per_step": round(kernels / steps, 1),
            "top": {k: round(v / steps, 2) for k, v in ops.most_common(8)},
            "tokens": hashlib.sha1(repr([o.outputs[0].token_ids for o in outs]).encode())
            .hexdigest()[:12]}


def main() -> None:
    ap = host_args(["vanilla", "paused", "drafting"])
    ap.add_argument("--sampled", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=48)
    a = ap.parse_args()
    torch.set_num_threads(1)
    _annotate_replays()
    target, head, tok = tiny_pair()
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 511) for _ in range(rng.randint(8, 24))]
               for _ in range(a.batch)]
    sp = (SamplingParams(max_tokens=a.max_tokens, temperature=0.8, top_p=0.9, seed=7,
                         ignore_eos=True) if a.sampled else
          SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True))
    for v in a.variants:
        for graphs in ((True, False) if a.sampled else (True,)):
            llm = _engine("vanilla" if v == "vanilla" else "eagle", target, head, tok, a.batch,
                          policy="adaptive" if v == "paused" else "always")
            if v == "paused":
                llm.engine.stats.policy = ModesInTurn([PLAIN])
            if not graphs:
                llm.engine.runner.sample_graph = None  # the draws eager, as before
            name = v + ("" if not a.sampled else " (draws replayed)" if graphs else " (draws eager)")
            print(name, json.dumps(_row(llm, prompts, sp)), flush=True)


if __name__ == "__main__":
    main()
