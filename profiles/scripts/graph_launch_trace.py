"""Per CUDA graph launch in a profiler trace: its kernels, the host time of `cudaGraphLaunch`,
and how long the GPU sat idle before the graph's first kernel (issues 15 and 16).

In the sixth session's H200 trace of a tree step (results/2026-12-01_h200_session6/), the
expand graph's first kernel ran ~20 us after its launch began (the GPU works while the host is
still launching), but the verify graph's ran only after its 0.38-0.54 ms launch had returned:
the GPU idled through the whole launch, every step. This prints that for any trace, e.g. the
``tree_step.pt.trace.json.gz`` the ``trees`` phase brings back.

Read the launch times with care: they are the profiler's. Untraced, the seventh session's
``graph_launch_h200.py`` timed ``graph.replay()`` of a 400-kernel graph at 5.0 us of host time
(800 kernels: 8.3 us), against ~500 us for the same graph in a trace; with CUDA activity on,
the profiler pays ~1.2 us per kernel node inside the launch, and the GPU waits for it. A
graph's own GPU time without the profiler was ~1.1 us per tiny kernel (439 us for 400), with
no visible start delay (50 kernels: 49.4 us). So a trace says which kernels run and for how
long, not what launching costs an untraced step (results/2026-12-01_h200_session7/).

python profiles/scripts/graph_launch_trace.py TRACE.json[.gz] [--skip 6] [--limit 12]
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
from collections import defaultdict


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def launches(events: list[dict]) -> list[dict]:
    """One row per cudaGraphLaunch: kernels, host us, GPU idle us before its first kernel,
    whether the GPU was still busy with earlier work when the launch began, GPU span us."""
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    ends = sorted(e["ts"] + e["dur"] for e in gpu)
    by_corr: dict = defaultdict(list)
    for e in gpu:
        by_corr[e.get("args", {}).get("correlation")].append(e)
    rows = []
    for launch in sorted((e for e in events if e.get("cat") == "cuda_runtime"
                          and e["name"] == "cudaGraphLaunch"), key=lambda e: e["ts"]):
        ks = by_corr.get(launch.get("args", {}).get("correlation"), [])
        if not ks:
            continue
        first = min(k["ts"] for k in ks)
        i = bisect.bisect_right(ends, first) - 1
        prior_end = ends[i] if i >= 0 else None
        rows.append({
            "kernels": len(ks), "first_kernel": ks[0]["name"][:40],
            "launch_us": launch["dur"],
            "idle_before_us": None if prior_end is None else first - prior_end,
            "busy_at_launch": prior_end is not None and prior_end > launch["ts"],
            "start_after_launch_end_us": first - (launch["ts"] + launch["dur"]),
            "gpu_span_us": max(k["ts"] + k["dur"] for k in ks) - first})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=6, help="leading launches left out (warm-up)")
    ap.add_argument("--limit", type=int, default=12, help="launches printed")
    a = ap.parse_args()
    rows = launches(load(a.trace))[a.skip:]
    print("kernels  launch us  GPU idle before  start - launch end  busy at launch  span us")
    for r in rows[:a.limit]:
        idle = "-" if r["idle_before_us"] is None else f"{r['idle_before_us']:.1f}"
        print(f"{r['kernels']:7d}  {r['launch_us']:9.1f}  {idle:>15}  "
              f"{r['start_after_launch_end_us']:18.1f}  {str(r['busy_at_launch']):>14}  "
              f"{r['gpu_span_us']:7.1f}")
    by_size: dict = defaultdict(list)
    for r in rows:
        by_size[r["kernels"]].append(r)
    for n, rs in sorted(by_size.items()):
        launch = statistics.median(x["launch_us"] for x in rs)
        idle = statistics.median(x["idle_before_us"] or 0.0 for x in rs)
        print(f"graph of {n} kernels, {len(rs)} launches: launch {launch:.1f} us "
              f"({launch / n:.2f} us/kernel), GPU idle before its first kernel {idle:.1f} us "
              f"(median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
