"""Kernels of one engine phase in a profiler trace (``bench --trace-dir``, the trees phase's
``chain_step`` / ``tree_step`` traces): count, busy time and the per-kernel table of the N-th
``verify`` or ``propose`` annotation, or (``--seq``) its kernels in launch order, to see which
ones run eagerly between compiled regions.

python profiles/scripts/trace_kernels.py TRACE.pt.trace.json[.gz] [--phase verify|propose]
    [--index 4] [--seq] [--top 25]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json


def phase_kernels(trace: dict, phase: str, index: int) -> tuple[dict, list[dict]]:
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    spans = [e for e in ev if e.get("cat") == "gpu_user_annotation" and e["name"] == phase]
    if index >= len(spans):
        raise SystemExit(f"{len(spans)} {phase!r} annotations in the trace, asked for #{index}")
    span = spans[index]
    kern = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return span, [k for k in kern if span["ts"] <= k["ts"] < span["ts"] + span["dur"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--phase", default="verify", choices=("verify", "propose"))
    ap.add_argument("--index", type=int, default=4, help="which occurrence (0 is the prefill's)")
    ap.add_argument("--seq", action="store_true", help="kernels in launch order")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        span, ks = phase_kernels(json.load(f), a.phase, a.index)
    busy = sum(k["dur"] for k in ks)
    print(f"{a.phase} #{a.index}: {len(ks)} kernels, busy {busy:.0f} us, annotation "
          f"{span['dur']:.0f} us (under the profiler: launches and gaps inflate the span)")
    if a.seq:
        for k in ks:
            print(f"{k['dur']:7.1f}  {k['name'][:90]}")
        return
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for k in ks:
        agg[k["name"][:90]][0] += 1
        agg[k["name"][:90]][1] += k["dur"]
    print(f"{'calls':>5} {'us':>8} {'us/call':>7}  kernel")
    for name, (c, d) in sorted(agg.items(), key=lambda x: -x[1][1])[:a.top]:
        print(f"{int(c):5d} {d:8.1f} {d / c:7.2f}  {name}")


if __name__ == "__main__":
    main()
