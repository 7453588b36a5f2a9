"""Where the GPU idles inside each engine step of a torch.profiler chrome trace, and what the
host was doing meanwhile (issue 15: the tree step costs 1.83x the chain's, with the GPU idle
~0.9 ms of it).

A step is the host's time from one marker annotation (``prepare`` where it marks at least as
many steps as ``verify``, else ``verify``: an engine whose steps run early or launched ahead
marks ``prepare`` on its few late steps only) to the next. Inside it, the GPU's busy time is the union of its kernels and copies
(every stream), and every idle gap longer than ``--min-gap`` us is attributed, microsecond by
microsecond, to what the host thread was inside of at that moment, innermost first:

* a runtime call: ``graph launch`` (cudaGraphLaunch), ``eager launch`` (cudaLaunchKernel,
  cuLaunchKernel[Ex]), ``copy`` (cudaMemcpyAsync / cudaMemsetAsync to the device), ``sync``
  (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, a device-to-host copy);
* else an aten op (its outermost one): ``aten <op>``, host overhead of an eager op;
* else the innermost user annotation: ``python <annotation>`` (host Python between launches),
  or ``python (no annotation)``.

Eager GPU work (kernels and copies not launched by cudaGraphLaunch) is listed per step by the
outermost aten op (or annotation) around its launch: what a captured graph could absorb.

Read graph launches with care: under the profiler, cudaGraphLaunch costs ~1.25 us of host time
per kernel node and the GPU waits for it, untraced a 400-node launch costs ~5 us
(results/2026-12-01_h200_session7/). The summary therefore also gives the idle time without
``graph launch``, an estimate of the untraced idle.

python profiles/scripts/trace_gaps.py TRACE.json[.gz] [--skip 1] [--min-gap 5] [--quiet]
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
SYNC = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}
COPY = {"cudaMemcpyAsync", "cudaMemsetAsync", "cudaMemcpy"}


@dataclass
class Gap:
    start: float  # us, trace clock
    dur: float
    gpu_phase: str  # the GPU annotation the gap lies in ("-": none)
    causes: Counter  # cause -> us of the gap
    in_flight: list[tuple[str, float]]  # host events overlapping it: (name, overlap us)
    next_op: str  # the GPU op after the gap and what launched it


@dataclass
class Step:
    start: float
    end: float
    busy: float = 0.0
    idle: float = 0.0  # all idle time, small gaps included
    gaps: list[Gap] = field(default_factory=list)
    eager: Counter = field(default_factory=Counter)  # op -> GPU us of eager work
    eager_n: Counter = field(default_factory=Counter)  # op -> kernels and copies
    graph_launch_us: list[float] = field(default_factory=list)
    host: Counter = field(default_factory=Counter)  # the whole step's host time by cause


def load(trace: str | dict) -> list[dict]:
    """Complete ('X') events of a chrome trace: a path (.json or .json.gz) or the dict."""
    if isinstance(trace, str):
        with (gzip.open if trace.endswith(".gz") else open)(trace, "rt") as f:
            trace = json.load(f)
    return [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _corr(e: dict) -> object:
    return e.get("args", {}).get("correlation")


class Trace:
    def __init__(self, events: list[dict], marker: str | None = None) -> None:
        ua = [e for e in events if e.get("cat") == "user_annotation"]
        n = Counter(e["name"] for e in ua)
        # (fifty-fifth session: "prepare" on 3-4 of a paused engine's 33 steps made one step
        # of most of the trace, and the summary empty)
        self.marker = marker or ("prepare" if n["prepare"] and n["prepare"] >= n["verify"]
                                 else "verify")
        marks = sorted((e for e in ua if e["name"] == self.marker), key=lambda e: e["ts"])
        if not marks:
            raise ValueError(f"no '{self.marker}' user annotation in the trace")
        tid = (marks[0]["pid"], marks[0]["tid"])  # the engine's host thread
        self.host = sorted((e for e in events if (e["pid"], e["tid"]) == tid
                            and e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime",
                                                 "cuda_driver", "python_function")),
                           key=lambda e: e["ts"])
        self.gpu = sorted((e for e in events if e.get("cat") in GPU_CATS), key=lambda e: e["ts"])
        self.gpu_ann = sorted((e for e in events if e.get("cat") == "gpu_user_annotation"),
                              key=lambda e: e["ts"])
        self._gpu_by_corr = {_corr(e): e for e in self.gpu}
        self.launcher = {_corr(e): e for e in self.host
                         if e.get("cat") in ("cuda_runtime", "cuda_driver") and _corr(e)}
        self._host_ts = [e["ts"] for e in self.host]
        self._max_host_dur = max((e["dur"] for e in self.host), default=0.0)
        host_end = max(e["ts"] + e["dur"] for e in self.host)
        self.bounds = [e["ts"] for e in marks] + [host_end]

    def overlapping(self, a: float, b: float) -> list[dict]:
        """Host events that overlap [a, b) (index by start; scan back by the longest event)."""
        lo = bisect.bisect_left(self._host_ts, a - self._max_host_dur)
        hi = bisect.bisect_left(self._host_ts, b)
        return [e for e in self.host[lo:hi] if e["ts"] + e["dur"] > a]

    def enclosing_op(self, e: dict) -> str:
        """The outermost aten op around a host event, else its innermost annotation."""
        around = [x for x in self.overlapping(e["ts"], e["ts"] + 1e-3)
                  if x["ts"] <= e["ts"] and x["ts"] + x["dur"] >= e["ts"] + e["dur"]]
        ops = [x for x in around if x.get("cat") == "cpu_op"]
        if ops:
            return min(ops, key=lambda x: x["ts"])["name"]
        anns = [x for x in around if x.get("cat") == "user_annotation"]
        return f"({max(anns, key=lambda x: x['ts'])['name']}: {e['name']})" if anns \
            else f"({e['name']})"

    def cause(self, around: list[dict]) -> str:
        """What the host is inside of, by the priority in the module docstring."""
        rt = [e for e in around if e.get("cat") in ("cuda_runtime", "cuda_driver")]
        if rt:
            e = max(rt, key=lambda x: x["ts"])
            name = e["name"]
            if name == "cudaGraphLaunch":
                return "graph launch"
            if name in LAUNCH:
                return "eager launch"
            if name in SYNC:
                return "sync"
            if name in COPY:
                gpu = self._gpu_by_corr.get(_corr(e))
                return "sync (D2H copy)" if gpu and "DtoH" in gpu["name"] else "copy"
            return f"runtime {name}"
        ops = [e for e in around if e.get("cat") == "cpu_op"]
        if ops:
            return f"aten {min(ops, key=lambda x: x['ts'])['name']}"
        anns = [e for e in around if e.get("cat") in ("user_annotation", "python_function")]
        if anns:
            return f"python {max(anns, key=lambda x: x['ts'])['name']}"
        return "python (no annotation)"

    def attribute(self, a: float, b: float) -> tuple[Counter, list[tuple[str, float]]]:
        """Split [a, b) by the host events' edges; each piece goes to ``cause``."""
        evs = self.overlapping(a, b)
        cuts = sorted({a, b} | {t for e in evs for t in (e["ts"], e["ts"] + e["dur"])
                                if a < t < b})
        causes: Counter = Counter()
        # A sweep over the pieces with the events open at each (added by start, dropped by
        # end), not a scan of every event per piece: a step's thousands of host events made
        # that quadratic (an 80 MB CPU trace ran over 10 minutes, fifty-fifth session).
        by_start = sorted(evs, key=lambda e: e["ts"])
        by_end = sorted(evs, key=lambda e: e["ts"] + e["dur"])
        open_: dict[int, dict] = {}
        i = j = 0
        for x, y in zip(cuts, cuts[1:]):
            mid = (x + y) / 2
            while i < len(by_start) and by_start[i]["ts"] <= mid:
                open_[id(by_start[i])] = by_start[i]
                i += 1
            while j < len(by_end) and by_end[j]["ts"] + by_end[j]["dur"] <= mid:
                open_.pop(id(by_end[j]), None)
                j += 1
            causes[self.cause(list(open_.values()))] += y - x
        flight = [(e["name"], min(b, e["ts"] + e["dur"]) - max(a, e["ts"])) for e in evs
                  if e.get("cat") != "user_annotation"]
        return causes, flight

    def gpu_phase(self, t: float) -> str:
        names = [e["name"] for e in self.gpu_ann if e["ts"] <= t < e["ts"] + e["dur"]]
        return names[-1] if names else "-"

    def steps(self, min_gap: float = 5.0) -> list[Step]:
        out = []
        for s0, s1 in zip(self.bounds, self.bounds[1:]):
            st = Step(s0, s1)
            # GPU busy intervals clipped to the step, merged over streams.
            ivs = sorted((max(s0, e["ts"]), min(s1, e["ts"] + e["dur"]), e) for e in self.gpu
                         if e["ts"] < s1 and e["ts"] + e["dur"] > s0)
            prev_end = s0
            for a, b, e in ivs:
                if a > prev_end:
                    self._gap(st, prev_end, a, e, min_gap)
                st.busy += max(0.0, b - max(a, prev_end))
                prev_end = max(prev_end, b)
                self._eager(st, e, b - a)
            if s1 > prev_end:
                self._gap(st, prev_end, s1, None, min_gap)
            st.host = self.attribute(s0, s1)[0]
            st.graph_launch_us = [e["dur"] for e in self.overlapping(s0, s1)
                                  if e["name"] == "cudaGraphLaunch" and s0 <= e["ts"] < s1]
            out.append(st)
        return out

    def _gap(self, st: Step, a: float, b: float, nxt: dict | None, min_gap: float) -> None:
        st.idle += b - a
        if b - a <= min_gap:
            return
        causes, flight = self.attribute(a, b)
        launch = self.launcher.get(_corr(nxt)) if nxt is not None else None
        nxt_s = "-" if nxt is None else f"{nxt['name'][:40]} <- " + (
            f"{launch['name']} @{launch['ts'] - a:+.0f}us" if launch else "?")
        st.gaps.append(Gap(a, b - a, self.gpu_phase(a), causes, flight, nxt_s))

    def _eager(self, st: Step, e: dict, us: float) -> None:
        launch = self.launcher.get(_corr(e))
        if launch is None or launch["name"] == "cudaGraphLaunch":
            return
        op = self.enclosing_op(launch)
        st.eager[op] += us
        st.eager_n[op] += 1


def summarize(steps: list[Step]) -> dict:
    """Per-step means over ``steps``: times (us), idle by cause, eager GPU work by op."""
    n = max(1, len(steps))
    causes: Counter = Counter()
    eager: Counter = Counter()
    eager_n: Counter = Counter()
    host: Counter = Counter()
    for st in steps:
        host.update(st.host)
        for g in st.gaps:
            causes.update(g.causes)
        eager.update(st.eager)
        eager_n.update(st.eager_n)
    big = sum(causes.values())
    idle = sum(st.idle for st in steps)
    causes["gaps <= min-gap (GPU-side, kernel to kernel)"] = idle - big
    mean = {"step_us": sum(st.end - st.start for st in steps) / n,
            "gpu_busy_us": sum(st.busy for st in steps) / n, "gpu_idle_us": idle / n,
            "gaps_per_step": sum(len(st.gaps) for st in steps) / n,
            "graph_launches_per_step": sum(len(st.graph_launch_us) for st in steps) / n}
    mean["idle_without_graph_launch_us"] = (idle - causes["graph launch"]) / n
    return {"steps": len(steps), "mean": mean,
            "idle_by_cause_us": {k: v / n for k, v in causes.most_common()},
            "host_by_cause_us": {k: v / n for k, v in host.most_common()},
            "eager_gpu_us_by_op": {k: v / n for k, v in eager.most_common()},
            "eager_ops_per_step": {k: eager_n[k] / n for k, _ in eager.most_common()}}


def _grouped(causes: dict[str, float]) -> dict[str, float]:
    """Causes folded into the issue's groups."""
    out: Counter = Counter()
    for k, v in causes.items():
        group = ("host python" if k.startswith("python") else
                 "eager ops (host side)" if k.startswith("aten") or k == "eager launch" else
                 "sync" if k.startswith("sync") else k)
        out[group] += v
    return dict(out.most_common())


def report(steps: list[Step], skip: int, quiet: bool, top: int = 6) -> dict:
    for i, st in enumerate(steps):
        print(f"step {i}{' (skipped)' if i < skip else ''}: {(st.end - st.start):.0f} us, "
              f"GPU busy {st.busy:.0f}, idle {st.idle:.0f} ({len(st.gaps)} gaps), graph "
              f"launches {len(st.graph_launch_us)} ({sum(st.graph_launch_us):.0f} us host)")
        if quiet:
            continue
        for g in st.gaps:
            cs = ", ".join(f"{k} {v:.0f}" for k, v in g.causes.most_common(3))
            fl = ", ".join(f"{n} {u:.0f}" for n, u in sorted(g.in_flight, key=lambda x: -x[1])
                           [:top])
            print(f"  +{g.start - st.start:7.0f} {g.dur:6.0f} us [{g.gpu_phase}] by: {cs}\n"
                  f"           host: {fl or '-'}\n           then: {g.next_op}")
        if st.eager:
            print("  eager GPU work: " + ", ".join(
                f"{k} x{st.eager_n[k]} {v:.1f}us" for k, v in st.eager.most_common(8)))
    s = summarize(steps[skip:])
    s["idle_by_group_us"] = _grouped(s["idle_by_cause_us"])
    s["host_by_group_us"] = _grouped(s["host_by_cause_us"])
    print(f"\n== summary over {s['steps']} steps (first {skip} skipped), us per step")
    print(json.dumps(s, indent=1))
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--marker", default=None, help="step annotation (default prepare/verify)")
    ap.add_argument("--skip", type=int, default=1, help="steps left out of the summary "
                    "(the first is usually the prefill)")
    ap.add_argument("--min-gap", type=float, default=5.0, help="us")
    ap.add_argument("--quiet", action="store_true", help="no per-gap lines")
    a = ap.parse_args()
    tr = Trace(load(a.trace), a.marker)
    report(tr.steps(a.min_gap), a.skip, a.quiet)


if __name__ == "__main__":
    main()
