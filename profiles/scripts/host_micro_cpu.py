"""Issue 16: host microseconds of per-step helpers at batch 1 and 64 on the CPU (no model): what a
late chain step (sampled requests, logprobs, a prompt) pays in Python before its launches.

- ``split_first_pass`` of a proposal with nothing to cut (every late proposal calls it);
- ``build_sampling_tensors`` of a sampled verify (k + 1 rows per request);
- the prompt head's row arithmetic (engine/prompt_head.py: the kept rows' gather index and the
  heads' rows) for 1,536 prompt rows.

  python profiles/scripts/host_micro_cpu.py [--reps 2000]
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import numpy as np
import torch


def _us(fn: Callable[[], Any], reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return round((time.perf_counter() - t0) / reps * 1e6, 2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()

    from compiled_spec.engine.batch import Span, build_sampling_tensors
    from compiled_spec.engine.prompt_head import concat_ranges
    from compiled_spec.sampling_params import SamplingParams
    from compiled_spec.spec.first_pass_split import split_first_pass
    from compiled_spec.spec.propose_batch import ProposeBatch

    class Req:  # what build_sampling_tensors reads of a request
        def __init__(self, i: int) -> None:
            self.params = SamplingParams(temperature=0.8, top_p=0.9, seed=i)
            self.seed = i

    k = 5
    cpu = torch.device("cpu")
    for b in (1, 64):
        spans = [Span(i, 100 + 40 * i, k + 1) for i in range(b)]
        n = b * (k + 1)
        pb = ProposeBatch(first_pass=spans, token_ids=list(range(n)), hidden_rows=list(range(n)),
                          step_limits=[0] * b, temperature=[0.8] * b, seeds=list(range(b)))
        reqs = [Req(i) for i in range(b)]
        print(f"batch {b}: split_first_pass, nothing cut {_us(lambda: split_first_pass(pb, k + 1), a.reps)} us; "
              f"build_sampling_tensors x{k + 1} rows {_us(lambda: build_sampling_tensors(reqs, cpu, k + 1), a.reps)} us")
    # The head's arithmetic for 64 prompts of 24 tokens (k + 1 kept each)
    lengths = np.full(64, 24, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    cuts = lengths - (k + 1)

    def head_rows() -> None:  # as PromptHead.launch: the kept rows, the heads' rows
        concat_ranges(starts + cuts, lengths - cuts)
        at = np.flatnonzero(cuts)
        concat_ranges(starts[at], cuts[at])

    print(f"prompt head rows, 64 x 24 tokens: {_us(head_rows, a.reps)} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
