"""Hugging Face transformers baselines, batch 1, greedy, on the same prompt ids as ours:

* ``hf_eager``: ``generate`` with its default dynamic cache;
* ``hf_compile``: its documented compile path, ``cache_implementation="static"`` (generate then
  compiles the forward with torch.compile, mode reduce-overhead, on CUDA; on the CPU we ask for it
  through ``CompileConfig``), warm-up included in the start-up time;
* ``hf_prompt_lookup``: prompt lookup decoding (``prompt_lookup_num_tokens``), an n-gram drafter
  that needs no head.

ms/token excludes the prefill: a logits processor stamps each step, and the time from the first
step's logits to the last one's is divided by the tokens added in between.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from compiled_spec.bench.timing import Row, floor_ms, peak_gib, reset_peak, sync

KINDS = ("hf_eager", "hf_compile", "hf_prompt_lookup")
LABELS = {"hf_eager": "transformers generate eager",
          "hf_compile": "transformers static cache + torch.compile",
          "hf_prompt_lookup": "transformers prompt lookup decoding"}


def load_hf(model_path: str, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    p = Path(model_path)
    if p.suffix == ".gguf":
        m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype)
    return m.to(device).eval()


def _gen_kwargs(kind: str, device: torch.device, lookup_tokens: int) -> dict[str, Any]:
    if kind == "hf_compile":
        from transformers import CompileConfig

        cc = CompileConfig(fullgraph=True)
        if device.type != "cuda":  # generate only auto-compiles on accelerators
            cc._compile_all_devices = True
        # The static cache itself is passed per call (see bench_hf): one fixed max_cache_len, so
        # prompts of other lengths and other max_new_tokens do not recompile.
        return {"compile_config": cc}
    if kind == "hf_prompt_lookup":
        return {"prompt_lookup_num_tokens": lookup_tokens}
    return {}


def bench_hf(kind: str, model_path: str, dtype: torch.dtype, device: torch.device,
             prompts: list[list[int]], max_tokens: int, lookup_tokens: int = 10
             ) -> tuple[Row, list[list[int]]]:
    reset_peak(device)
    t0 = time.perf_counter()
    model = load_hf(model_path, dtype, device)
    kw = _gen_kwargs(kind, device, lookup_tokens)
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    cache = None
    if kind == "hf_compile":
        from transformers import StaticCache

        # transformers' documented way to keep one compiled graph across calls: a StaticCache of
        # one size for every prompt, reset between calls (a fresh cache per generate, sized by
        # each prompt, recompiled per call: ~7 s per prompt on the H200 with transformers 5.17).
        cache = StaticCache(config=model.config,
                            max_cache_len=max(len(p) for p in prompts) + max_tokens + 8)

    clock = _StepClock(device)

    def gen(ids: list[int], n: int) -> torch.Tensor:
        x = torch.tensor([ids], device=device)
        extra = dict(kw, logits_processor=[clock])
        clock.reset()
        with torch.inference_mode():  # the cache's tensors are inference tensors after a call
            if cache is not None:
                cache.reset()
                extra["past_key_values"] = cache
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=pad, **extra)

    if kind == "hf_compile":  # compile (and cudagraph capture) belongs to start-up
        for ids in (prompts[0], prompts[-1]):
            gen(ids, 8)
    sync(device)
    startup = time.perf_counter() - t0
    ms, outs, total_tokens, wall = [], [], 0, 0.0
    for ids in prompts:
        gen(ids, 1)  # this prompt's prefill shape, off the clock
        sync(device)
        t0 = time.perf_counter()
        y = gen(ids, max_tokens)
        sync(device)
        dt = time.perf_counter() - t0
        wall += dt
        new = y[0, len(ids):].tolist()
        total_tokens += len(new)
        outs.append(new)
        # Decode time per token from the step clock (first to last logits of this call): no
        # subtraction of a separately timed prefill, which on a noisy host can exceed the whole
        # run and give a negative figure.
        ms.append(clock.ms_per_token())
    row = Row(engine=LABELS[kind], batch=1, ms_per_token=statistics.median(ms),
              tokens_per_s=total_tokens / wall, startup_s=startup, peak_mem_gib=peak_gib(device))
    fl = floor_ms(model, device)
    row.floor_ratio = row.ms_per_token / fl if fl else None
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row, outs


class _StepClock:
    """A logits processor that only records when each generation step's logits arrive (after a
    device sync) and how long the sequence was: decode ms per token = time between the first and
    the last step / tokens added in between (prompt lookup may add several per step)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[tuple[float, int]] = []

    def reset(self) -> None:
        self.marks = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        sync(self.device)
        self.marks.append((time.perf_counter(), input_ids.shape[-1]))
        return scores

    def ms_per_token(self) -> float:
        (t0, n0), (t1, n1) = self.marks[0], self.marks[-1]
        if n1 <= n0:
            raise RuntimeError(f"step clock saw {len(self.marks)} steps and no new tokens")
        return 1e3 * (t1 - t0) / (n1 - n0)
