"""``compiled-spec profile``: a torch.profiler trace of generation, readable in TensorBoard
(torch-tb-profiler), with the propose / verify latencies read back from the trace itself
(``profile.phase_latencies``).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from compiled_spec.profile import print_phases, trace_calls


def run_profile(a: argparse.Namespace) -> int:
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.bench import load_mt_bench, mt_bench_prompts
    from compiled_spec.engine_args import engine_kwargs

    llm = LLM(**engine_kwargs(a))
    texts = load_mt_bench(a.prompts, a.num_prompts)
    prompts = mt_bench_prompts(llm, texts)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    batch = getattr(a, "batch", 1)
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"--batch {batch!r}: must be a positive integer")
    # Warm-up at the profiled batch size: a first call of a new shape may compile (Dynamo) and
    # the trace would show compilation instead of steps.
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    llm.generate(prompts[:batch] if batch > 1 else prompts[0], warm)
    if batch > 1:  # the step cost without the profiler's own overhead, for comparison
        steps0, t0 = llm.stats.num_steps, time.perf_counter()
        llm.generate(prompts[:batch], sp)
        secs, steps = time.perf_counter() - t0, llm.stats.num_steps - steps0
        print(f"untraced: batch {batch}, {steps} engine steps in {secs:.2f} s "
              f"({1e3 * secs / max(steps, 1):.2f} ms each)")
    def run() -> None:
        for i in range(0, len(prompts), batch):  # --batch requests per call (default one)
            llm.generate(prompts[i:i + batch] if batch > 1 else prompts[i], sp)

    trace = trace_calls(llm, run, Path(a.out_dir) / time.strftime("%Y%m%d-%H%M%S"),
                        getattr(a, "kernel_table", 0))
    print(f"trace: {trace}\nview:  tensorboard --logdir {a.out_dir}   (pip install torch-tb-profiler)")
    lat = print_phases(trace)
    if "propose" not in lat and llm.config.spec is not None:
        print("warning: no propose ranges in the trace")
    return 0
