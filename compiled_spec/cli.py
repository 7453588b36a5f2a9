"""The ``compiled-spec`` command line: generate, bench, acceptance, parity, profile, train."""
from __future__ import annotations

import argparse
import sys
import time

from compiled_spec.engine_args import add_engine_args as _add_engine_args
from compiled_spec.engine_args import add_prompt_args as _add_prompt_args
from compiled_spec.engine_args import engine_kwargs as _engine_kwargs

DEFAULT_PROMPT = "Write a short poem about speculative decoding."


def cmd_generate(a: argparse.Namespace) -> int:
    from compiled_spec import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**_engine_kwargs(a))
    load_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                        top_k=a.top_k, min_p=a.min_p, seed=a.seed)
    prompts = a.prompt or [DEFAULT_PROMPT]
    t0 = time.perf_counter()
    if a.raw:
        outs = llm.generate(prompts, sp)
    else:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], sp)
    gen_s = time.perf_counter() - t0
    n_tok = sum(len(o.token_ids) for o in outs)
    for p, o in zip(prompts, outs):
        print(f"### prompt: {p}\n{o.text}\n[{len(o.token_ids)} tokens, finish_reason={o.finish_reason}]\n")
    mode = "vanilla decoding"
    if llm.config.spec is not None:
        st = llm.stats.spec
        tau = st.mean_acceptance_length
        mode = (f"{llm.draft_method} k={llm.config.spec.num_speculative_tokens}, "
                f"mean acceptance length {tau:.2f}" if tau is not None else "speculative, no drafting step")
    print(f"model {llm.config.model} on {llm.config.device} ({llm.config.dtype}); load {load_s:.1f} s; "
          f"{n_tok} tokens in {gen_s:.2f} s = {n_tok / gen_s:.1f} tokens/s (batch {len(prompts)}, {mode})")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from compiled_spec.bench import run_bench

    return run_bench(a)


def cmd_acceptance(a: argparse.Namespace) -> int:
    from compiled_spec.acceptance import run_acceptance

    return run_acceptance(a)


def cmd_parity(a: argparse.Namespace) -> int:
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.bench import load_mt_bench, mt_bench_prompts

    llm = LLM(**_engine_kwargs(a))
    prompts = mt_bench_prompts(llm, load_mt_bench(a.prompts, a.num_prompts))
    rep = llm.check_parity(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0.0),
                           tau_tolerance=a.tau_tolerance)
    print(rep)
    print(f"compile stats: {llm.compile_stats}")
    return 0 if rep.ok else 1


def cmd_profile(a: argparse.Namespace) -> int:
    from compiled_spec.profile_run import run_profile

    return run_profile(a)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="compiled-spec", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for prompts (chat template applied)")
    _add_engine_args(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="our engines (vanilla / EAGLE, eager / compiled, batch 1-64) "
                       "next to transformers, one process; writes BENCHMARKS.md + JSON + PNG")
    _add_engine_args(b)
    _add_prompt_args(b, num_prompts=10, max_tokens=256)
    from compiled_spec.bench.run import add_bench_args
    add_bench_args(b)
    b.set_defaults(func=cmd_bench)

    from compiled_spec.train.cli import add_train_parser
    add_train_parser(sub)

    pr = sub.add_parser("profile", help="torch.profiler trace (TensorBoard) with propose/verify latency")
    _add_engine_args(pr)
    _add_prompt_args(pr, num_prompts=2, max_tokens=32)
    pr.add_argument("--out-dir", default="profiles/traces")
    pr.add_argument("--batch", type=int, default=1,
                    help="requests per generate call (a large batch profiles the engine as it "
                    "runs self-distillation)")
    pr.add_argument("--kernel-table", type=int, default=0, metavar="N",
                    help="also print the N ops with the most device (else host) time")
    pr.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also run the batch once under cProfile and print the N Python "
                    "functions with the most own time per engine step")
    pr.set_defaults(func=cmd_profile)

    pa = sub.add_parser("parity", help="eager vs compiled: tau, per-position acceptance, first divergence")
    _add_engine_args(pa)
    _add_prompt_args(pa, num_prompts=4, max_tokens=64)
    pa.add_argument("--tau-tolerance", type=float, default=0.05)
    pa.set_defaults(func=cmd_parity)

    ac = sub.add_parser("acceptance", help="tau and per-position acceptance of a head on MT-bench")
    _add_engine_args(ac)
    _add_prompt_args(ac, num_prompts=80, max_tokens=256)
    ac.add_argument("--k-list", type=int, nargs="+", default=[3, 5, 7])
    ac.add_argument("--out", default=None)
    ac.set_defaults(func=cmd_acceptance)

    a = ap.parse_args(argv)
    try:
        return a.func(a)
    except (ValueError, OSError) as e:  # bad input, missing / unreadable files: no traceback
        print(f"compiled-spec: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

