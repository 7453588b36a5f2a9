"""``compiled-spec bench``: our vanilla decoding next to transformers ``generate`` in one run.

Batch 1, greedy, chat-templated MT-bench first turns, a fixed number of new tokens (EOS ignored,
so both engines produce the same count). Prints a table and optionally writes JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch


def load_mt_bench(path: str, n: int) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"prompt file {path!r} not found (MT-bench lives in ../shared/data/mt_bench/)")
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    return [r["turns"][0] if "turns" in r else r["prompt"] for r in rows[:n]]


def mt_bench_prompts(llm, texts: list[str]) -> list[list[int]]:
    """Each question as a one-turn chat with the model's template, as token ids."""
    return [llm.encode_chat([{"role": "user", "content": t}]) for t in texts]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _write_random_head(method: str, kw: dict) -> str:
    """A random head of the target's shape: tau near 1, so its speed shows the cost of speculating."""
    import tempfile

    from compiled_spec.draft.testing import write_eagle1_head, write_eagle3_head
    from compiled_spec.models.gguf_loader import find_default_gguf
    from compiled_spec.models.loader import load_model

    _, cfg = load_model(kw["model"] or find_default_gguf(), torch.float32, "cpu")
    d = tempfile.mkdtemp(prefix="random_head_")
    if method == "eagle3":
        return write_eagle3_head(d, cfg, draft_vocab_size=min(8192, cfg.vocab_size))
    return write_eagle1_head(d, cfg)


def _time_ours(llm, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    """Batch 1, one prompt at a time: decode ms per token (first token excluded), tau."""
    from compiled_spec import SamplingParams

    dev = llm.config.device
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    # Warm-up: two prompt lengths and several decode steps, so compiled graphs (static, then
    # dynamic shapes) exist before timing; its duration is the compile cost.
    t0 = time.perf_counter()
    for ids in (prompts[0][:16], prompts[-1]):
        llm.generate(ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    _sync(dev)
    warmup_s = time.perf_counter() - t0
    spec0 = llm.stats.spec.num_drafting_steps, llm.stats.spec.num_accepted_tokens
    ms, toks = [], []
    for ids in prompts:
        _sync(dev)
        out = llm.generate(ids, sp)[0]
        m = out.metrics
        ms.append(1000 * (m.finish_time - m.first_token_time) / (len(out.token_ids) - 1))
        toks.append(out.token_ids)
    row: dict = {"ms_per_token": statistics.median(ms), "warmup_s": warmup_s}
    steps = llm.stats.spec.num_drafting_steps - spec0[0]
    if steps:
        row["tau"] = 1 + (llm.stats.spec.num_accepted_tokens - spec0[1]) / steps
    return row, toks


def run_bench(a: argparse.Namespace) -> int:
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.cli import _engine_kwargs

    texts = load_mt_bench(a.prompts, a.num_prompts)
    kw = _engine_kwargs(a)
    modes = [False, True] if a.compile else [False]
    variants = [(f"compiled_spec vanilla {'compiled' if c else 'eager'}", {**kw, "draft": None, "compile": c})
                for c in modes]
    head = a.draft
    if head is None and a.random_draft:
        head = _write_random_head(a.random_draft, kw)
    if head is not None:
        tag = " (random head)" if a.draft is None else ""
        variants += [(f"compiled_spec {a.method or 'EAGLE'} k={a.num_speculative_tokens} "
                      f"{'compiled' if c else 'eager'}{tag}", {**kw, "draft": head, "compile": c})
                     for c in modes]
    rows, ours_tokens = [], None
    for name, vkw in variants:
        t0 = time.perf_counter()
        llm = LLM(**vkw)
        startup = time.perf_counter() - t0
        dev = llm.config.device
        prompts = mt_bench_prompts(llm, texts)
        row, toks = _time_ours(llm, prompts, a.max_tokens)
        row.update(engine=name, startup_s=startup)
        if ours_tokens is None:
            ours_tokens = toks
        row["greedy_identical"] = f"{sum(x == y for x, y in zip(toks, ours_tokens))}/{len(toks)}"
        rows.append(row)

    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        path = Path(llm.config.model)
        t0 = time.perf_counter()
        if path.suffix == ".gguf":
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=llm.config.dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=llm.config.dtype)
        hf = hf.to(llm.config.device).eval()
        dev = llm.config.device
        hf_startup = time.perf_counter() - t0
        hf_ms: list[float] = []
        agree = 0
        for ids, mine in zip(prompts, ours_tokens):
            x = torch.tensor([ids], device=dev)
            with torch.inference_mode():
                hf.generate(x, max_new_tokens=1, do_sample=False)  # prefill cost, subtracted below
                _sync(dev)
                t0 = time.perf_counter()
                hf.generate(x, max_new_tokens=1, do_sample=False)
                _sync(dev)
                t_first = time.perf_counter() - t0
                t0 = time.perf_counter()
                y = hf.generate(x, max_new_tokens=a.max_tokens, min_new_tokens=a.max_tokens, do_sample=False)
                _sync(dev)
                total = time.perf_counter() - t0
            hf_ms.append(1000 * (total - t_first) / (a.max_tokens - 1))
            agree += int(y[0, len(ids):].tolist() == mine)
        rows.append({"engine": "transformers generate eager", "ms_per_token": statistics.median(hf_ms),
                     "startup_s": hf_startup, "greedy_identical": f"{agree}/{len(prompts)}"})

    print(f"\nbatch 1, greedy, {len(prompts)} MT-bench prompts, {a.max_tokens} new tokens, "
          f"{dev} {llm.config.dtype}, torch {torch.__version__}")
    print(f"{'engine':55s} {'ms/token':>9s} {'tokens/s':>9s} {'tau':>5s} {'load s':>7s} {'warm-up s':>9s}"
          "  greedy==vanilla")
    for r in rows:
        tau = f"{r['tau']:5.2f}" if "tau" in r else "    -"
        warm = f"{r['warmup_s']:9.1f}" if "warmup_s" in r else "        -"
        print(f"{r['engine']:55s} {r['ms_per_token']:9.2f} {1000 / r['ms_per_token']:9.1f} {tau} "
              f"{r['startup_s']:7.1f} {warm}  {r.get('greedy_identical', '-')}")
    if a.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "device": str(dev), "dtype": str(llm.config.dtype),
                "torch": torch.__version__, "host": platform.processor() or platform.machine(),
                "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
                "num_prompts": len(prompts), "max_tokens": a.max_tokens, "rows": rows}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(meta, indent=2))
    return 0
