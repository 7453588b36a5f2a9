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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_bench(a: argparse.Namespace) -> int:
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.cli import _engine_kwargs

    texts = load_mt_bench(a.prompts, a.num_prompts)
    t0 = time.perf_counter()
    llm = LLM(**_engine_kwargs(a))
    startup = time.perf_counter() - t0
    dev = llm.config.device
    prompts = [llm.encode_chat([{"role": "user", "content": t}]) for t in texts]
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[0][:16], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up

    ours_ms: list[float] = []
    ours_tokens: list[list[int]] = []
    for ids in prompts:
        _sync(dev)
        out = llm.generate(ids, sp)[0]
        m = out.metrics
        ours_ms.append(1000 * (m.finish_time - m.first_token_time) / (len(out.token_ids) - 1))
        ours_tokens.append(out.token_ids)
    rows = [{"engine": "compiled_spec vanilla eager", "ms_per_token": statistics.median(ours_ms),
             "startup_s": startup}]

    if not a.no_hf:
        from transformers import AutoModelForCausalLM

        path = Path(llm.config.model)
        t0 = time.perf_counter()
        if path.suffix == ".gguf":
            hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=llm.config.dtype)
        else:
            hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=llm.config.dtype)
        hf = hf.to(dev).eval()
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
    print(f"{'engine':34s} {'ms/token':>9s} {'tokens/s':>9s} {'startup s':>10s}  greedy==ours")
    for r in rows:
        print(f"{r['engine']:34s} {r['ms_per_token']:9.2f} {1000 / r['ms_per_token']:9.1f} "
              f"{r['startup_s']:10.1f}  {r.get('greedy_identical', '-')}")
    if a.out:
        meta = {"date": time.strftime("%Y-%m-%d"), "device": str(dev), "dtype": str(llm.config.dtype),
                "torch": torch.__version__, "host": platform.processor() or platform.machine(),
                "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None,
                "num_prompts": len(prompts), "max_tokens": a.max_tokens, "rows": rows}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(meta, indent=2))
    return 0
