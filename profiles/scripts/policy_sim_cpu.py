"""Issue 16: the adaptive policy (compiled_spec/spec/policy.py) on simulated acceptance (CPU,
no model): tokens per ms of batch-1 decoding where drafting pays in some stretches and not in
others, against drafting always and against an oracle that knows each stretch.

python profiles/scripts/policy_sim_cpu.py [--seeds 6]

Step costs are the H100's at batch 1 (forty-third session, shipped head): a drafting step
1.145 ms, a plain one 0.815 ms (0.775 with a random head). Each draft position is accepted with
probability q given the ones before it were: 0.8 in a "high" stretch (tau 3.69 at k=5), 0.1 in
a "low" one; stretches alternate with exponential lengths (their mean in steps). Policies:
``old`` probes only every probe_every (256) steps (probe_first = 256), ``new`` the default
(probe_first = 8, doubling). Both see each new request through ``admitted``.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec.spec.policy import PLAIN, SPEC, SpecPolicy  # noqa: E402

SPEC_MS, PLAIN_MS, PLAIN_MS_RANDOM = 1.145, 0.815, 0.775


def _policy(kind: str, probe_first: int | None = None) -> SpecPolicy:
    if kind == "old":
        return SpecPolicy(k=5, probe_first=256)
    return SpecPolicy(k=5) if probe_first is None else SpecPolicy(k=5, probe_first=probe_first)


def stretches(kind: str, seed: int, low_len: float, high_len: float = 150.0, requests: int = 150,
              q_low: float = 0.1, q_high: float = 0.8, probe_first: int | None = None) -> float:
    """Tokens per ms over ``requests`` requests of 256 tokens each."""
    rng = random.Random(seed)
    p = None if kind in ("always", "oracle") else _policy(kind, probe_first)
    toks, ms, prev = 0, 0.0, None
    for _ in range(requests):
        if p is not None:
            p.admitted(1)
            prev = p.mode(1)  # the prompt step
        left, low, seg = 256, rng.random() < 0.3, 0
        while left > 0:
            seg -= 1
            if seg <= 0:
                low = not low
                seg = int(rng.expovariate(1 / (low_len if low else high_len))) + 1
            q = q_low if low else q_high
            if kind == "always":
                m = SPEC
            elif kind == "oracle":
                m = SPEC if q > 0.5 else PLAIN
            else:
                m = p.mode(1)
            if m == SPEC:
                a = 0
                while a < 5 and rng.random() < q:
                    a += 1
                n, dt = 1 + a, SPEC_MS
                if p is not None:
                    p.observe_acceptance(1, [5], [a])
            else:
                n, dt = 1, PLAIN_MS
            if p is not None and m == prev:
                p.observe(1, m, dt * 1e-3, float(n))
            prev = m
            left -= n
            toks += n
            ms += dt
    return toks / ms


def random_head(kind: str, requests: int = 40) -> float:
    """Tokens per ms with a draft that is never accepted (vanilla: 1 / 0.775)."""
    p = _policy(kind)
    toks, ms, prev = 0, 0.0, None
    for _ in range(requests):
        p.admitted(1)
        prev = p.mode(1)
        for _ in range(256):
            m = p.mode(1)
            dt = SPEC_MS if m == SPEC else PLAIN_MS_RANDOM
            if m == SPEC:
                p.observe_acceptance(1, [5], [0])
            if m == prev:
                p.observe(1, m, dt * 1e-3, 1.0)
            prev = m
            toks += 1
            ms += dt
    return toks / ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=6)
    a = ap.parse_args()
    for low_len in (10, 40, 150):
        row = {k: round(statistics.mean(stretches(k, s, low_len) for s in range(a.seeds)), 3)
               for k in ("always", "oracle", "old", "new")}
        print(json.dumps({"low_stretch_steps": low_len, "tokens_per_ms": row}))
    for pf in (4, 8, 16, 32, 64):
        row = {low: round(statistics.mean(stretches("new", s, low, probe_first=pf)
                                          for s in range(a.seeds)), 3) for low in (10, 40, 150)}
        print(json.dumps({"probe_first": pf, "tokens_per_ms_by_low_stretch": row}))
    print(json.dumps({"random_head_tokens_per_ms": {k: round(random_head(k), 4)
                                                    for k in ("old", "new")},
                      "vanilla": round(1 / PLAIN_MS_RANDOM, 4)}))


if __name__ == "__main__":
    main()
