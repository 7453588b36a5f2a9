"""Each row of a bench's benchmarks.json on a few lines: tokens/s, step times and their
quantiles, the host's phases, and what the adaptive policy, the deferred first pass and verify
ahead did (the figures the session READMEs quote).

    python profiles/scripts/bench_rows.py profiles/results/<session>/<run>.json
"""
from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    rows = json.load(open(path))["rows"]
    for r in rows:
        e = r.get("extra", {})
        print(f"{r['engine']} | b{r['batch']} | {r['tokens_per_s']} tok/s | step {e.get('step_ms')}"
              f" | p50/p90/max {e.get('decode_step_ms_p50_p90_max')}"
              f" | wait {e.get('host_wait_ms')} | idle {e.get('gpu_idle_at_verify')}"
              f" | rounds {e.get('rounds_tokens_per_s')}")
        print("   phases", e.get("host_phase_ms"))
        for k in ("deferred_first_pass", "policy", "verify_ahead", "early_propose",
                  "steps_without_graph", "sample_draw_replays"):
            if k in e:
                print("  ", k, json.dumps(e[k]))
    for r in rows:  # the host's ms per flush, from the totals
        f = r.get("extra", {}).get("deferred_first_pass")
        if f and f.get("flushes"):
            print(f"{r['engine']} b{r['batch']}: {f.get('flush_ms', 0) / f['flushes']:.3f} ms "
                  "host per flush")


if __name__ == "__main__":
    main(sys.argv[1])
