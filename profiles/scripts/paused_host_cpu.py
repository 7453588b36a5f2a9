"""Issue 16: the host side of a paused EAGLE-3 decode step against a vanilla one at batch 64,
on the CPU.

On the H100 (results/2026-12-07_h100_session54/, pausedab) a paused step at batch 64 took
1.33-1.37 ms against vanilla's 1.01 ms, the GPU idle at most launches: host-bound. The host
side runs the same code on any device, so it is measured here with a tiny target (vocab 512,
hidden 32, 3 layers, attention returning zeros) and a random EAGLE-3 head, compiled over our
passes (no Inductor) and routed through emulated CUDA graphs captured by the engine's own
policy. "paused": speculation_policy="adaptive" held at PLAIN every step (the draft's first
pass only, deferred and flushed as on the GPU). "drafting" (``--variants ... drafting``):
speculation_policy="always", every decode step an early-proposing chain step (on the H100 at
batch 64 every such step launched its verify onto an idle GPU: its host time is its step time).

Per variant: the decode steps' mean host phases (engine/host_clock.py; the emulated replays'
CPU compute is timed and printed beside), then with ``--cprofile`` the functions with the most
own time per decode step. The "tokens" digest must not change when the host code is optimised
(greedy: every variant's is the same). "host_ms": the decode steps less all replays' compute
per decode step (the prompt steps' replays included, as in "replay_ms_per_step").

Read small numpy costs with care: inside the engine, after a replay's compute, ``padded_tables``
(64 tables) took 70 us where the same call repeated at once took 26 and a loop of it alone 13
(fifty-fifth session): cold caches, which the GPU host's own Python work brings too.

.venv/bin/python profiles/scripts/paused_host_cpu.py [--batch 64] [--variants vanilla paused drafting]
                                                    [--cprofile] [--temperature 0.8]
"""
from __future__ import annotations

import cProfile
import hashlib
import json
import pstats
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from compiled_spec import SamplingParams  # noqa: E402
from compiled_spec.spec.policy import PLAIN  # noqa: E402
from profiles.scripts.prompt_step_host_cpu import (_MODEL_S, _engine, host_args,  # noqa: E402
                                                   tiny_pair)
from tests.policy_stub import ModesInTurn  # noqa: E402


def _run(llm, batch: int, max_tokens: int, seed: int, prof: cProfile.Profile | None,
         temperature: float = 0.0) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 511) for _ in range(rng.randint(8, 24))] for _ in range(batch)]
    # seeded as the GPU scripts' sampled rows (greedy_vs_sampled_gpu.py): one seed per request
    sp = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True,
                         seed=i) for i in range(batch)]
    es = llm.engine.stats
    hp0, n0, s0 = dict(es.host_phase_s), es.num_steps, es.step_s
    p0, ps0 = es.num_prefill_steps, es.prefill_step_s
    _MODEL_S[0] = 0.0
    if prof is not None:
        prof.enable()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if prof is not None:
        prof.disable()
    nd = es.num_steps - n0 - (es.num_prefill_steps - p0)
    return {"decode_steps": nd,
            "decode_step_ms": round(1e3 * (es.step_s - s0 - (es.prefill_step_s - ps0)) / nd, 3),
            "replay_ms_per_step": round(1e3 * _MODEL_S[0] / nd, 3),
            "host_ms": round(1e3 * (es.step_s - s0 - (es.prefill_step_s - ps0) - _MODEL_S[0]) / nd, 3),
            "phases_ms": {k: round(1e3 * (v - hp0.get(k, 0.0)) / nd, 3)
                          for k, v in es.host_phase_s.items()},
            "tokens": hashlib.sha1(repr([o.outputs[0].token_ids for o in outs]).encode())
            .hexdigest()[:12]}


def main() -> None:
    ap = host_args(["vanilla", "paused"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled requests (seeded), the draws' host side")
    a = ap.parse_args()
    torch.set_num_threads(1)
    target, head, tok = tiny_pair()
    for v in a.variants:
        llm = _engine("vanilla" if v == "vanilla" else "eagle", target, head, tok, a.batch,
                      policy="adaptive" if v == "paused" else "always")
        _run(llm, a.batch, 8, 1000, None, a.temperature)  # warm: Dynamo guards, first replays
        if v == "paused":
            llm.engine.stats.policy = ModesInTurn([PLAIN])  # PLAIN every step
        print(v, json.dumps(_run(llm, a.batch, a.max_tokens, 0, None, a.temperature)),
              flush=True)
        if a.cprofile:
            prof = cProfile.Profile()
            _run(llm, a.batch, a.max_tokens, 0, prof, a.temperature)
            print(f"-- {v}: cProfile (prompt steps included)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
