"""Why an EAGLE-3 engine that compiled in its own process ran batch 64 at 34,017 tok/s (host-bound,
decode step p50 3.24 ms) while a fresh process serving the same graphs from the compile cache ran
54,604 (p50 1.85 ms) on the H200 (nineteenth session; not reproduced on the CPU). Answered by
this probe's own runs: two identical cache-served processes ran 33,940 and 48,737 tok/s, so the
spread is the host's speed per process, not the compile
(``profiles/results/2026-12-03_h200_session19/``).

Runs ``compiled-spec bench`` (arguments after ``--``) in this process with two probes:
- SHUTDOWN=1: Inductor's compile workers shut down once each engine is ready (before the heap
  freeze), so no worker process or pool thread outlives the compile;
- SAMPLE=1: a sampling thread records the main thread's stack every 2 ms from the first engine's
  readiness on and prints where the host spent its time (top frames, own and inclusive).
``ps`` of this process's children (CPU used by compile workers) is printed at exit.
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time

import compiled_spec.llm_compile as lc

_orig = lc.freeze_startup_heap
_samples: collections.Counter[str] = collections.Counter()
_incl: collections.Counter[str] = collections.Counter()
_started = threading.Event()


def _sampler(main_id: int) -> None:
    while True:
        time.sleep(0.002)
        frame = sys._current_frames().get(main_id)
        if frame is None:
            continue
        seen: set[str] = set()
        leaf = True
        while frame is not None:
            code = frame.f_code
            key = f"{os.path.basename(code.co_filename)}:{code.co_name}"
            if leaf:
                _samples[f"{key}:{frame.f_lineno}"] += 1
                leaf = False
            if key not in seen:
                _incl[key] += 1
                seen.add(key)
            frame = frame.f_back


def _ready_hook() -> float:
    if os.environ.get("SHUTDOWN") == "1":
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
        print("probe: compile workers shut down", flush=True)
    if os.environ.get("SAMPLE") == "1" and not _started.is_set():
        _started.set()
        threading.Thread(target=_sampler, args=(threading.main_thread().ident,),
                         daemon=True).start()
    return _orig()


lc.freeze_startup_heap = _ready_hook


def main() -> int:
    from compiled_spec.cli import main as cli_main

    try:
        return cli_main(sys.argv[1:])
    finally:
        ps = subprocess.run(["ps", "--ppid", str(os.getpid()), "-o", "pid,time,pcpu,nlwp,args"],
                            capture_output=True, text=True).stdout
        print("probe: children\n" + "\n".join(line[:160] for line in ps.splitlines()))
        print(f"probe: threads alive {[t.name for t in threading.enumerate()]}")
        import torch

        if torch.cuda.is_available():  # allocator retries / device frees: syncs inside ops
            st = torch.cuda.memory_stats()
            print("probe: allocator " + str({k: st.get(k) for k in (
                "num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                "reserved_bytes.all.peak", "reserved_bytes.all.current")}))
        if _samples:
            total = sum(_samples.values())
            print(f"probe: {total} samples; top leaf lines")
            for k, n in _samples.most_common(30):
                print(f"  {n / total:6.1%}  {k}")
            print("probe: top inclusive functions")
            for k, n in _incl.most_common(45):
                print(f"  {n / total:6.1%}  {k}")


if __name__ == "__main__":
    raise SystemExit(main())
