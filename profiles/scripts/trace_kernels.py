"""Kernels of one engine phase in a profiler trace (``bench --trace-dir``, the trees phase's
``chain_step`` / ``tree_step`` traces): count, busy time and the per-kernel table of the N-th
``verify`` or ``propose`` annotation, or (``--seq``) its kernels in launch order, to see which
ones run eagerly between compiled regions. ``--graph-nodes MIN MAX``: instead, the mean over
every CUDA-graph replay whose graph has MIN..MAX kernel / copy nodes (graphs told apart by their
node count: SmolLM2's tree verify has 305, the chain's 309, the tree's early propose 183, the
chain's propose 93): span (first node's start to the last's end), busy time, kernel table.

python profiles/scripts/trace_kernels.py TRACE.pt.trace.json[.gz] [--phase verify|propose]
    [--index 4] [--seq] [--top 25] [--graph-nodes MIN MAX]
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


def graph_replays(trace: dict, lo: int, hi: int) -> list[list[dict]]:
    """The nodes (kernels and copies, in start order) of each graph replay with lo..hi nodes:
    a replay's nodes carry its cudaGraphLaunch's correlation id."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    launches = {e["args"].get("correlation") for e in ev if e.get("name") == "cudaGraphLaunch"}
    nodes: dict[int, list[dict]] = collections.defaultdict(list)
    for e in ev:
        c = e.get("args", {}).get("correlation")
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and c in launches:
            nodes[c].append(e)
    return [sorted(ks, key=lambda e: e["ts"]) for ks in nodes.values() if lo <= len(ks) <= hi]


def print_table(ks: list[dict], per: int, top: int) -> None:
    agg: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for k in ks:
        agg[k["name"][:90]][0] += 1
        agg[k["name"][:90]][1] += k["dur"]
    print(f"{'calls':>7} {'us':>8} {'us/call':>7}  kernel" + ("  (per replay)" if per > 1 else ""))
    for name, (c, d) in sorted(agg.items(), key=lambda x: -x[1][1])[:top]:
        print(f"{c / per:7.1f} {d / per:8.1f} {d / c:7.2f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--phase", default="verify", choices=("verify", "propose"))
    ap.add_argument("--index", type=int, default=4, help="which occurrence (0 is the prefill's)")
    ap.add_argument("--seq", action="store_true", help="kernels in launch order")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--graph-nodes", type=int, nargs=2, metavar=("MIN", "MAX"), default=None)
    a = ap.parse_args()
    opener = gzip.open if a.trace.endswith(".gz") else open
    with opener(a.trace, "rt") as f:
        trace = json.load(f)
    if a.graph_nodes is not None:
        reps = graph_replays(trace, *a.graph_nodes)
        if not reps:
            raise SystemExit(f"no graph replay with {a.graph_nodes[0]}..{a.graph_nodes[1]} nodes")
        n = len(reps)
        span = sum(ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"] for ks in reps) / n
        busy = sum(k["dur"] for ks in reps for k in ks) / n
        print(f"{n} replays: span {span:.1f} us, busy {busy:.1f} us per replay")
        print_table([k for ks in reps for k in ks], n, a.top)
        return
    span, ks = phase_kernels(trace, a.phase, a.index)
    busy = sum(k["dur"] for k in ks)
    print(f"{a.phase} #{a.index}: {len(ks)} kernels, busy {busy:.0f} us, annotation "
          f"{span['dur']:.0f} us (under the profiler: launches and gaps inflate the span)")
    if a.seq:
        for k in ks:
            print(f"{k['dur']:7.1f}  {k['name'][:90]}")
        return
    print_table(ks, 1, a.top)


if __name__ == "__main__":
    main()
