"""A benchmark's engines of ours, variant after variant (``rounds`` = 1) or built together
and timed in turn (``rounds`` > 1), each traced on its warm engine if asked, each row in the log
as soon as it is known."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from compiled_spec.bench.ours import Variant, build_engine, time_engine
from compiled_spec.bench.timing import Row


def trace_engine(llm: Any, v: Variant, prompts: list[list[int]], batch: int, out_dir: Path,
                 max_tokens: int = 32, table_rows: int = 30) -> Path:
    """A torch.profiler trace of ``batch`` requests at once on the variant's warm engine
    (compiled and captured already: a separate ``compiled-spec profile`` would compile and
    capture again, minutes for a tree engine), with the ops' device-time table and the phases'
    latencies printed. Returns the trace file. ``batch`` is the first batch size the bench
    timed: a shape it did not meet (a 1-request prefill on an engine warmed at batch 4) would
    compile inside the trace (the tenth session's batch-4 trace spent ~25 s of host time so)."""
    from compiled_spec import SamplingParams
    from compiled_spec.profile import print_phases, trace_calls

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    chosen = [prompts[i % len(prompts)] for i in range(batch)]
    print(f"trace of {v.name} ({batch} request{'s' if batch > 1 else ''} x {max_tokens} tokens):")
    trace = trace_calls(llm, lambda: llm.generate(chosen if batch > 1 else chosen[0], sp),
                        out_dir / "".join(c if c.isalnum() else "_" for c in v.name).strip("_"),
                        table_rows)
    print_phases(trace)
    print(f"trace: {trace}", flush=True)
    return Path(trace)


def bench_ours(variants: list[Variant], kw: dict[str, Any], prompts: list[list[int]],
               batch_sizes: list[int], max_tokens: int, trace_dir: Path | None = None,
               waves: int = 1, rounds: int = 1, temperature: float = 0.0
               ) -> tuple[list[Row], dict[str, list[list[int]]]]:
    """``trace_dir``: after timing, a profiler trace of each variant's warm engine there.
    ``waves``: see ``time_engine``. ``rounds`` > 1: every engine built first, then timed in
    turn, round after round (A B A B ...), each row the round of median tokens/s: the host's
    speed drifts within a process (the thirty-third session's chain row ran 3x slower than
    four minutes before, on an unchanged engine), and one pass per engine lays that drift on
    whichever engine ran then."""
    rows: list[Row] = []
    outputs: dict[str, list[list[int]]] = {}
    if rounds > 1:
        built = [(v, *build_engine(v, kw, prompts, batch_sizes, max_tokens)) for v in variants]
        timed: dict[str, list[list[Row]]] = {v.name: [] for v in variants}
        for i in range(rounds):
            for v, llm, startup in built:
                r, out = time_engine(llm, v, prompts, batch_sizes, max_tokens, startup, waves,
                                     temperature)
                timed[v.name].append(r)
                outputs.setdefault(v.name, out)
                print(f"{v.name}: round {i + 1} of {rounds}: " + ", ".join(
                    f"batch {x.batch} {x.tokens_per_s:.1f} tok/s" for x in r), flush=True)
        for v, llm, _ in built:
            r = [_median_round([rr[j] for rr in timed[v.name]]) for j in range(len(batch_sizes))]
            _report(v, r)
            rows += r
            if trace_dir is not None:
                trace_engine(llm, v, prompts, batch_sizes[0], trace_dir)
        return rows, outputs
    for v in variants:
        llm, startup = build_engine(v, kw, prompts, batch_sizes, max_tokens)
        r, out = time_engine(llm, v, prompts, batch_sizes, max_tokens, startup, waves,
                             temperature)
        if trace_dir is not None:
            trace_engine(llm, v, prompts, batch_sizes[0], trace_dir)
        rows += r
        outputs[v.name] = out
        _report(v, r)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows, outputs


def _median_round(per_round: list[Row]) -> Row:
    """The round of median tokens/s (the lower middle of an even count), with every round's
    tokens/s and the first round's start-up (later rounds' warm-up runs are not start-up)."""
    chosen = sorted(per_round, key=lambda r: r.tokens_per_s)[(len(per_round) - 1) // 2]
    chosen.startup_s = per_round[0].startup_s
    chosen.extra["rounds_tokens_per_s"] = [round(r.tokens_per_s, 1) for r in per_round]
    return chosen


def _report(v: Variant, r: list[Row]) -> None:
    """A variant's rows in the log as soon as they are known."""
    print(f"{v.name}: " + ", ".join(
        f"batch {x.batch} {x.tokens_per_s:.1f} tok/s (step {x.extra.get('step_ms')} ms, "
        f"of which waiting for the GPU {x.extra.get('host_wait_ms')} ms; decode steps "
        f"{x.extra.get('decode_step_ms')} ms, {x.extra.get('prefill_steps')} prompt steps "
        f"{x.extra.get('prefill_ms')} ms)" for x in r),
        flush=True)
    for x in r:
        if "host_phase_ms" in x.extra:
            print(f"{v.name}: batch {x.batch} host ms per decode step by phase: "
                  f"{x.extra['host_phase_ms']}; target launches finding the GPU idle: "
                  f"{x.extra.get('gpu_idle_at_verify')}; per prompt step: "
                  f"{x.extra.get('prompt_host_phase_ms')}; host CPU {x.extra.get('host_cpu')}",
                  flush=True)
    for x in r:  # whole rows in the log: a later variant that kills the process (a CUDA
        # fault aborts it) would otherwise take every row with it (twentieth session)
        print("ROW " + json.dumps(x.as_dict(), default=str), flush=True)
    if r and "startup_split_s" in r[0].extra:
        print(f"{v.name}: start-up {r[0].extra['startup_split_s']} s (compile + capture "
              f"by step: {r[0].extra['startup_detail_s']}), compile cache "
              f"{r[0].extra['compile_cache']}", flush=True)
