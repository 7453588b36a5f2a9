"""Issue 16: the host time of a paused engine's deferred first-pass flush, by part (CPU).

On the H100 (forty-sixth session) a full ring's flush at batch 64 took 1.52-1.56 ms of host
time, once per 32 paused steps. This runs host_overhead_cpu.py's engine (the tiny bigram
target + EAGLE-3 head, compiled, emulated CUDA graphs) with every step paused and times each
flush with its emulated replay taken out (on a GPU a replay is one launch), and the parts of
it named below (their calls inside flushes only). On the CPU the fc and the row gather are
computed here, where a GPU only launches them.

    python profiles/scripts/flush_host_cpu.py [--batch 64] [--tokens 200] [--rounds 3]
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import host_overhead_cpu as ho  # noqa: E402  (its replay timing is installed on import)

from compiled_spec import LLM  # noqa: E402
from compiled_spec.engine import batch as bt  # noqa: E402
from compiled_spec.engine import deferred_first_pass as dfp  # noqa: E402
from compiled_spec.engine import propose_graph as pg  # noqa: E402
from compiled_spec.engine import sync_graph as sg  # noqa: E402
from compiled_spec.models.gguf_loader import find_default_gguf  # noqa: E402
from compiled_spec.spec.policy import PLAIN  # noqa: E402
from tests.policy_stub import ModesInTurn  # noqa: E402

SECONDS: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()
FLUSH_MS: list[float] = []
_IN_FLUSH = [False]


def _timed(obj: Any, name: str, label: str) -> None:
    """``obj.name`` timed under ``label`` while a flush runs."""
    real = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        if not _IN_FLUSH[0]:
            return real(*a, **k)
        t0 = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            SECONDS[label] += time.perf_counter() - t0
            CALLS[label] += 1

    setattr(obj, name, wrapper)


def _install() -> None:
    flush = dfp.DeferredFirstPass._flush

    def timed_flush(self: dfp.DeferredFirstPass, why: str, newest: int | None = None) -> None:
        _IN_FLUSH[0] = True
        r0, t0 = ho._REPLAY_S[0], time.perf_counter()
        try:
            flush(self, why, newest)
        finally:
            _IN_FLUSH[0] = False
            FLUSH_MS.append(1e3 * (time.perf_counter() - t0 - (ho._REPLAY_S[0] - r0)))

    dfp.DeferredFirstPass._flush = timed_flush  # type: ignore[method-assign]
    for obj, name, label in ((dfp.DeferredFirstPass, "_settle", "settle run rows"),
                             (dfp.DeferredFirstPass, "_live", "live rows per request"),
                             (dfp, "to_device", "ring rows to the device"),
                             (sg.SyncGraphs, "_stage", "stage (all below)"),
                             (pg.StepCapture, "_rows", "  tables + span rows"),
                             (bt, "span_rows_np", "    span_rows_np"),
                             (sg, "stage_first_pass", "  ids / positions / slots / rows"),
                             (sg, "put_tables", "  block tables"),
                             (sg.SyncGraphs, "_upload", "  upload")):
        _timed(obj, name, label)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fixtures", default=".device/tc")
    a = ap.parse_args()
    torch.set_num_threads(1)
    target, head, tok = ho.fixtures(Path(a.fixtures), find_default_gguf())
    _install()
    b = a.batch
    llm = LLM(model=target, tokenizer=tok, max_model_len=256, max_num_seqs=b,
              num_kv_blocks=20 * b + 8, dtype="float32", draft=head, num_speculative_tokens=5,
              speculation_policy="adaptive", verify_ahead=True)
    _timed(type(llm.engine.runner.proposer.draft), "combine_aux", "  fc (computed on the CPU)")
    llm.engine.stats.policy = ModesInTurn([PLAIN])  # every step paused
    row: dict[str, Any] = {}
    for _ in range(a.rounds):
        row = ho.measure("paused", llm, 5, b, a.tokens, False, None, False)
    n = len(FLUSH_MS)
    full = [m for m in FLUSH_MS if m > 0.5 * max(FLUSH_MS)]  # full rings (others: few rows)
    print(f"batch {b}: {n} flushes, host ms per flush median {statistics.median(FLUSH_MS):.3f}"
          f" (full rings: {statistics.median(full):.3f}); last round's paused step: host "
          f"{row['host_ms_per_step_median']:.3f} ms, copy-to-launch "
          f"{row['sync_to_launch_ms_median']:.3f} ms (medians)")
    for label, s in SECONDS.items():
        print(f"  {label:36s} {1e3 * s / n:.3f} ms per flush ({CALLS[label]} calls)")


if __name__ == "__main__":
    main()
