"""Issue 16: the adaptive policy (compiled_spec/spec/policy.py) on simulated acceptance (CPU,
no model): tokens per ms of batch-1 decoding where drafting pays in some stretches and not in
others, against drafting always and against an oracle that knows each stretch.

python profiles/scripts/policy_sim_cpu.py [--seeds 6] [--ab]

Step costs are the H100's at batch 1 (forty-third session, shipped head): a drafting step
1.145 ms, a plain one 0.815 ms (0.775 with a random head). Each draft position is accepted with
probability q given the ones before it were: 0.8 in a "high" stretch (tau 3.69 at k=5), 0.1 in
a "low" one; stretches alternate with exponential lengths (their mean in steps). Policies:
``old`` probes only every probe_every (256) steps (probe_first = 256), ``new`` the default
(probe_first = 8, doubling). Both see each new request through ``admitted``.

``waves``: a batch of 64 running requests, 2 waves of 256 tokens each (128 requests, a
finished request's slot refilled: the bench's ``--waves 2``), with the engine's timing (a step
verifies the drafts of the step before it). Step costs interpolate between the H100's batch 1
and batch 64 (forty-third session: 2.0 ms drafting, 1.03 plain at 64). Heads: ``random``
(nothing accepted), ``good`` (q = 0.7 at every position) and ``comes_goes`` (q = 0.7 but 0 in
the first 40 steps of every 120). ``uncut`` is the engine's default policy, ``cut`` ends a
losing probe early (``cut_losing_probes=True``), ``flat`` is the default without the forty-sixth
session's back-off (``probe_backoff=False``: neither a paused bucket's probe intervals
stretched by the cost of drafting nor the admission probes backing off), ``always`` drafts
every step.
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


# The forty-fifth session's random head at batch 1 (H100): its probes' drafting steps took 1.545
# ms (the policy's estimate), not an always-drafting engine's 1.108
PROBE_SPEC_MS = 1.545


def random_head(kind: str, requests: int = 40, spec_ms: float = SPEC_MS) -> float:
    """Tokens per ms with a draft that is never accepted (vanilla: 1 / 0.775). Kinds: ``old``,
    ``new`` (as ``_policy``), ``flat``: new without the forty-sixth session's stretched
    intervals and admission back-off."""
    p = (SpecPolicy(k=5, probe_trials=None, probe_cost_ref=1e9, fresh_backoff=False)
         if kind == "flat" else _policy(kind))
    toks, ms, prev = 0, 0.0, None
    for _ in range(requests):
        p.admitted(1)
        prev = p.mode(1)
        for _ in range(256):
            m = p.mode(1)
            dt = spec_ms if m == SPEC else PLAIN_MS_RANDOM
            if m == SPEC:
                p.observe_acceptance(1, [5], [0])
            if m == prev:
                p.observe(1, m, dt * 1e-3, 1.0)
            prev = m
            toks += 1
            ms += dt
    return toks / ms


def _cost_ms(mode: str, batch: int) -> float:
    f = (batch - 1) / 63
    return (SPEC_MS + f * (2.0 - SPEC_MS)) if mode == SPEC else (PLAIN_MS_RANDOM + f * (1.03 - PLAIN_MS_RANDOM))


def waves(kind: str, head: str, seed: int = 0, batch: int = 64, n_waves: int = 2,
          tokens: int = 256) -> dict[str, float]:
    """Tokens per ms (and drafted steps) of a continuous batch, the engine's step timing."""
    rng = random.Random(seed)
    p = SpecPolicy(k=5, probe_trials=None if kind != "cut" else SpecPolicy.probe_trials,
                   probe_cost_ref=1e9 if kind == "flat" else SpecPolicy.probe_cost_ref,
                   fresh_backoff=kind != "flat")
    always = kind == "always"  # the policy out of the loop: every step drafts
    waiting, running = batch * n_waves, []  # running: tokens each request still needs
    toks, ms, prev, drafted, steps = 0, 0.0, None, 0, 0
    while waiting or running:
        q = 0.0 if head == "random" or (head == "comes_goes" and steps % 120 < 40) else 0.7
        new = min(batch - len(running), waiting)
        if new:
            waiting -= new
            running += [tokens] * new
            p.admitted(new)
        m = SPEC if always else p.mode(len(running))
        verify = prev is not None and prev != PLAIN and not new
        emitted, ks, accs = [], [], []
        for left in running:
            a = 0
            if verify:
                while a < 5 and rng.random() < q:
                    a += 1
                ks.append(5)
                accs.append(a)
            emitted.append(min(1 + a, left))
        dt = _cost_ms(m, len(running))
        if ks:
            p.observe_acceptance(len(running), ks, accs)
        if m == prev and not new:
            p.observe(len(running), m, dt * 1e-3, sum(emitted) / len(running))
        toks += sum(emitted)
        ms += dt
        steps += 1
        drafted += m != PLAIN
        running = [left - e for left, e in zip(running, emitted) if left - e > 0]
        prev = m
    return {"tokens_per_ms": toks / ms, "drafted_steps": drafted, "steps": steps}


# The forty-sixth session's two changes, each alone and both (--ab): the paused bucket's probe
# intervals stretched by drafting's extra cost (probe_cost_ref), the admission probes' back-off
AB = {"flat": dict(probe_cost_ref=1e9, fresh_backoff=False),
      "stretch": dict(fresh_backoff=False), "backoff": dict(probe_cost_ref=1e9), "both": {}}


def ab(seeds: int) -> None:
    """Batch 1: requests whose acceptance comes and goes, and a random head at the forty-fifth
    session's measured probe cost; batch-64 waves: random and comes-and-goes heads."""
    global _policy
    base = _policy
    try:
        for name, kw in AB.items():
            _policy = lambda kind, probe_first=None, kw=kw: SpecPolicy(k=5, probe_trials=None,
                                                                       **kw)
            row = {low: round(statistics.mean(stretches("new", s, low) for s in range(seeds)), 3)
                   for low in (10, 40, 150)}
            print(json.dumps({"ab": name, "b1_tokens_per_ms_by_low_stretch": row,
                              "b1_random_head_at_probe_cost": round(
                                  random_head("new", spec_ms=PROBE_SPEC_MS), 4)}))
    finally:
        _policy = base
    for kind in ("flat", "uncut"):
        for head in ("random", "comes_goes"):
            runs = [waves(kind, head, s) for s in range(seeds)]
            print(json.dumps({"ab_waves_b64": "flat" if kind == "flat" else "both", "head": head,
                              "tokens_per_ms": round(statistics.mean(r["tokens_per_ms"]
                                                                     for r in runs), 3),
                              "drafted_steps": statistics.mean(r["drafted_steps"] for r in runs)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--ab", action="store_true", help="the forty-sixth session's A/B alone")
    a = ap.parse_args()
    if a.ab:
        ab(a.seeds)
        return
    for low_len in (10, 40, 150):
        row = {k: round(statistics.mean(stretches(k, s, low_len) for s in range(a.seeds)), 3)
               for k in ("always", "oracle", "old", "new")}
        print(json.dumps({"low_stretch_steps": low_len, "tokens_per_ms": row}))
    for pf in (4, 8, 16, 32, 64):
        row = {low: round(statistics.mean(stretches("new", s, low, probe_first=pf)
                                          for s in range(a.seeds)), 3) for low in (10, 40, 150)}
        print(json.dumps({"probe_first": pf, "tokens_per_ms_by_low_stretch": row}))
    for spec_ms in (SPEC_MS, PROBE_SPEC_MS):
        print(json.dumps({"random_head_tokens_per_ms": {k: round(random_head(k, spec_ms=spec_ms), 4)
                                                        for k in ("old", "flat", "new")},
                          "spec_ms": spec_ms, "vanilla": round(1 / PLAIN_MS_RANDOM, 4)}))
    for head in ("random", "good", "comes_goes"):
        for kind in ("always", "flat", "uncut", "cut"):
            runs = [waves(kind, head, s) for s in range(a.seeds)]
            print(json.dumps({"waves_b64": head, "policy": kind,
                              "tokens_per_ms": round(statistics.mean(r["tokens_per_ms"]
                                                                     for r in runs), 3),
                              "drafted_steps": statistics.mean(r["drafted_steps"] for r in runs),
                              "steps": statistics.mean(r["steps"] for r in runs)}))
    print(json.dumps({"waves_b64_vanilla_tokens_per_ms": round(64 / 1.03, 3)}))


if __name__ == "__main__":
    main()
