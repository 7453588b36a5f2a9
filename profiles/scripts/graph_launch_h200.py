"""What a CUDA graph replay costs the host, by node count and node kind (issues 15 and 16).

The H200 trace of the sixth session shows `cudaGraphLaunch` taking 0.42 ms of host time for
the tree-verify graph (372 kernels) and 0.52 ms for the tree-expand graph (341 kernels), i.e.
~1.2-1.5 us per node, on steps that are host-bound (results/2026-12-01_h200_session6/). If
launch cost grows with the node count, fewer kernels per graph pay twice (host and GPU); if a
graph of one kind of node launches in constant time (CUDA's straight-line graph launch), the
question is what in our graphs prevents it. This times `graph.replay()` on the host for graphs
of N tiny nodes of several kinds, each captured from one stream:

- `aten`: N `add_` kernels (ATen's elementwise kernel);
- `triton`: N launches of a one-block Triton kernel (launched like our custom ops);
- `aten+memcpy`: `aten` with a device-to-device copy (a memcpy node) every 16 kernels;
- `aten+topk`: `aten` with a top-k over [8, 32768] every 16 kernels (as the tree expansion
  has: its multi-block top-k brings memset nodes, which the expand graph's trace shows).

python profiles/scripts/graph_launch_h200.py [--nodes 50 100 200 400 800] [--out FILE.json]

Host time per replay: the median over 200 replays, each followed by a synchronize outside the
timed region (the queue is empty when a replay starts, as on our host-bound steps); the GPU
time per replay from CUDA events, for scale.

Then, from a profiler trace of 20 replays per case (``graph_launch_trace.py``'s analysis): how
long the GPU idles before a graph's first kernel, i.e. whether the GPU starts on a graph while
the host is still inside ``cudaGraphLaunch``. On the H200 the tree-expand graph (with memset
and memcpy nodes) started ~30 us into its launch, the target's verify graph (kernels only) only
after its ~0.46 ms launch returned. Cases, for every kind at 100 and 400 nodes: the graph
alone; after a pinned host-to-device copy (as our staging uploads); while the GPU is still
busy (``torch.cuda._sleep`` queued first).

Answer (H200, seventh session, results/2026-12-01_h200_session7/graph_launch.log): untraced, a
replay costs the host 3.2-8.3 us whatever the node count (50-800 nodes; a top-k's sort and
memset nodes cost more: 54 us at 400); the GPU spends ~1.1 us per tiny kernel. The traced
"GPU idle through the launch" (517 us at 400 kernels, 608 us with memcpy nodes; 59-76 us with
top-k nodes) is the profiler's own cost per node, so cutting graphs into pieces cannot help
an untraced step (measured: chain k=5 1399.2 tok/s with the target cut every 5 layers vs
1415.6 whole). What a kernel costs is its GPU time, at least ~1.1 us: fewer kernels.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from capture.cuda_graphs import capture_graph  # noqa: E402  (the engine's own capture)
from graph_launch_trace import launches, load  # noqa: E402


def _triton_kernel() -> Callable[[torch.Tensor], None]:
    import triton
    import triton.language as tl

    @triton.jit
    def bump(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)

    def launch(x: torch.Tensor) -> None:
        bump[(1,)](x, x.numel(), BLOCK=256)
    return launch


def build(kind: str, nodes: int, x: torch.Tensor, y: torch.Tensor,
          tri: Callable[[torch.Tensor], None]) -> Callable[[], None]:
    big = torch.randn(8, 32768, device=x.device)

    def body() -> None:
        for i in range(nodes):
            if kind == "triton":
                tri(x)
            else:
                x.add_(1.0)
            if i % 16 == 15 and kind == "aten+memcpy":
                y.copy_(x)
            if i % 16 == 15 and kind == "aten+topk":
                torch.topk(big, 8, dim=-1)
    return body


def time_graph(body: Callable[[], None], reps: int) -> tuple[float, float]:
    """(median host us per replay, median GPU us per replay)."""
    g, _ = capture_graph(body)  # warmed up on a side stream first (Triton compiles)
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    host, gpu = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        start.record()
        t0 = time.perf_counter()
        g.replay()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) * 1e3)
    return statistics.median(host), statistics.median(gpu)


def start_delays(g: torch.cuda.CUDAGraph, before: str, reps: int = 20) -> dict[str, float]:
    """Median (launch host us, GPU idle us before the graph's first kernel) over ``reps``
    profiled replays, with ``before`` queued ahead of each replay."""
    pinned = torch.zeros(4096, dtype=torch.int64).pin_memory()
    dev = torch.zeros(4096, dtype=torch.int64, device="cuda")
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if before == "h2d":
                dev.copy_(pinned, non_blocking=True)
            elif before == "busy":
                torch.cuda._sleep(2_000_000)  # ~1 ms of spinning ahead of the replay
            g.replay()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "t.json")
        prof.export_chrome_trace(path)
        rows = launches(load(path))
    return {"launch_us": round(statistics.median(r["launch_us"] for r in rows), 1),
            "gpu_idle_before_us": round(statistics.median(
                r["idle_before_us"] or 0.0 for r in rows), 1),
            "start_after_launch_end_us": round(statistics.median(
                r["start_after_launch_end_us"] for r in rows), 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, nargs="+", default=[50, 100, 200, 400, 800])
    ap.add_argument("--kinds", nargs="+", default=["aten", "triton", "aten+memcpy", "aten+topk"])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch_h200.py needs a CUDA device")
    x = torch.zeros(256, device="cuda")
    y = torch.zeros(256, device="cuda")
    tri = _triton_kernel()
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}",
          flush=True)
    print("kind          nodes   host us/replay   host us/node   GPU us/replay", flush=True)
    for kind in a.kinds:
        for n in a.nodes:
            host, gpu = time_graph(build(kind, n, x, y, tri), a.reps)
            rows.append({"kind": kind, "nodes": n, "host_us": round(host, 1),
                         "gpu_us": round(gpu, 1)})
            print(f"{kind:12s} {n:6d}   {host:14.1f}   {host / n:12.2f}   {gpu:13.1f}",
                  flush=True)
    delays = []
    print("\nkind          nodes  before    launch us  GPU idle before 1st kernel  1st kernel - "
          "launch end", flush=True)
    for kind in a.kinds:
        for n in (100, 400):
            g, _ = capture_graph(build(kind, n, x, y, tri))
            for before in ("none", "h2d", "busy"):
                d = start_delays(g, before)
                delays.append({"kind": kind, "nodes": n, "before": before, **d})
                print(f"{kind:12s} {n:6d}  {before:7s} {d['launch_us']:10.1f}  "
                      f"{d['gpu_idle_before_us']:26.1f}  {d['start_after_launch_end_us']:22.1f}",
                      flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cuda": torch.version.cuda, "rows": rows, "start_delays": delays}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
