"""``compiled-spec acceptance``: tau and per-position acceptance of a draft head on MT-bench.

All prompts run as one batch (greedy decoding is lossless, so batching changes no token and no
acceptance decision), once per k. Tau is also reported per prompt category (MT-bench's eight:
writing, roleplay, reasoning, math, coding, extraction, stem, humanities), from the requests'
own acceptance counts: a head is judged on every kind of prompt, not on the average alone.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def run_acceptance(a: argparse.Namespace) -> int:
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.bench import load_mt_bench, mt_bench_prompts
    from compiled_spec.bench.prompts import load_categories
    from compiled_spec.engine_args import engine_kwargs

    if a.draft is None:
        raise ValueError("--draft is required: the head whose acceptance to measure")
    texts = load_mt_bench(a.prompts, a.num_prompts)
    categories = load_categories(a.prompts, a.num_prompts)
    results = []
    for k in a.k_list:
        # every step drafts: a head's acceptance, not what an adaptive policy chose to verify
        kw = {**engine_kwargs(a), "num_speculative_tokens": k, "max_num_seqs": len(texts),
              "speculation_policy": "always", "adaptive_k": ()}
        llm = LLM(**kw)
        prompts = mt_bench_prompts(llm, texts)
        sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        secs = time.perf_counter() - t0
        st = llm.stats.spec
        row = {"k": k, "tau": st.mean_acceptance_length,
               "acceptance_per_position": st.acceptance_rate_per_position,
               "draft_acceptance_rate": st.draft_acceptance_rate,
               "drafting_steps": st.num_drafting_steps,
               "output_tokens": sum(len(o.token_ids) for o in outs),
               "seconds_batched": secs, "tau_by_category": tau_by_category(outs, categories)}
        results.append(row)
        per_pos = " ".join(f"{x:.2f}" for x in (row["acceptance_per_position"] or []))
        print(f"k={k}: tau {row['tau']:.3f}  per-position acceptance [{per_pos}]  "
              f"({row['output_tokens']} tokens, batch {len(texts)}, {secs:.1f} s)", flush=True)
        if any(categories):
            cats = row["tau_by_category"].items()
            print("  tau by category: " + ", ".join(f"{c} {t['tau']:.2f} ({t['prompts']})"
                                                    for c, t in cats), flush=True)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if a.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "draft": a.draft, "num_prompts": len(texts),
                "max_tokens": a.max_tokens, "dtype": a.dtype, "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "results": results}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(meta, indent=2))
    return 0


def tau_by_category(outs: list, categories: list[str]) -> dict[str, dict[str, float]]:
    """Per category: tau = 1 + accepted drafts / drafting steps of its requests, and the
    number of prompts."""
    acc: dict[str, list[int]] = {}
    for o, c in zip(outs, categories):
        st = o.spec_stats
        a = acc.setdefault(c or "unlabelled", [0, 0, 0])
        a[0] += st.num_accepted_tokens if st else 0
        a[1] += st.num_drafting_steps if st else 0
        a[2] += 1
    return {c: {"tau": 1 + a / s if s else 1.0, "drafting_steps": s, "prompts": n}
            for c, (a, s, n) in sorted(acc.items())}
