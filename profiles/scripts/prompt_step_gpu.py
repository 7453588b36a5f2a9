"""Issue 16: why an EAGLE engine's prompt steps cost ~2-4x vanilla's on the GPU (the fiftieth
and fifty-first sessions' pausedab: 5.5 ms against 1.45 ms a prompt step at batch 1, the
prompt step's ``propose`` phase 4 ms of host time).

For each variant (vanilla, EAGLE-3 always drafting, EAGLE-3 adaptive; ``tree``: a draft tree
of 16 nodes) on a random SmolLM2-shaped
target with a random EAGLE-3 head (compiled, CUDA graphs), at one batch size:
1. prompt steps timed untraced: ``generate(max_tokens=2)`` per batch of prompts, the engine's
   own prompt-step time and host phases (engine/host_clock.py);
2. the same under cProfile: the Python functions with the most own and cumulative time per
   prompt step;
3. a torch.profiler trace of a few: CPU ops by self time, kernels by device time;
4. ``--head-ab N``: the EAGLE engines' prompt steps with their heads' draft KV written while
   the host waits (engine/prompt_head.py, the default) and after it, N rounds each in turn on
   the same engine (``prompt_head.enabled``).

  python3 profiles/scripts/prompt_step_gpu.py --tokenizer ~/tok --prompts question.jsonl \
      --out $OUT/prompt_step.json > $OUT/prompt_step.log
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any


def _engine(variant: str, model: str, head: str, tok: str, batch: int, device: str) -> Any:
    from compiled_spec import LLM
    from compiled_spec.compile import CompileConfig

    kw: dict[str, Any] = dict(model=model, tokenizer=tok, dtype="bfloat16", device=device,
                              max_num_seqs=batch, compile=True,
                              compile_config=CompileConfig(capture_batch_sizes=(batch,)))
    if variant != "vanilla":
        kw.update(draft=head, num_speculative_tokens=5,
                  speculation_policy="adaptive" if variant == "adaptive" else "always")
    if variant == "tree":  # a draft tree of 16 nodes, 4 deep (the forty-second session's)
        kw.update(speculative_topk=4, speculative_num_draft_tokens=16, speculative_num_steps=4)
    return LLM(**kw)


def random_pair(prefix: str) -> tuple[str, str]:
    """(model, head): a random SmolLM2-shaped target (``random:`` its config) and a random
    EAGLE-3 head for it (8,192-token draft vocabulary), written in a new temporary folder."""
    from compiled_spec.bench.run import SMOLLM2
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.loader import read_model_config

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    (tmp / "target").mkdir()
    (tmp / "target" / "config.json").write_text(json.dumps(SMOLLM2))
    model = f"random:{tmp / 'target'}"
    return model, write_eagle3_head(str(tmp / "head"), read_model_config(model),
                                    draft_vocab_size=8192)


def synthetic_prompts(n: int) -> list[list[int]]:
    """``n`` token-id prompts of 16-23 tokens (ids below 1,001), the same every call: what the
    random-weight scripts feed when no tokenizer text matters."""
    return [[1 + (7 * i + j) % 1000 for j in range(16 + i % 8)] for i in range(n)]


def _run(llm: Any, prompts: list[list[int]], batch: int, max_tokens: int) -> list[list[int]]:
    from compiled_spec import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for i in range(0, len(prompts), batch):
        out += [o.outputs[0].token_ids for o in llm.generate(prompts[i:i + batch], sp)]
    return out


def _prompt_steps(llm: Any, prompts: list[list[int]], batch: int) -> dict[str, Any]:
    es = llm.stats
    n0, s0, p0 = es.num_prefill_steps, es.prefill_step_s, dict(es.prompt_host_phase_s)
    t0 = time.perf_counter()
    tokens = _run(llm, prompts, batch, 2)
    wall = time.perf_counter() - t0
    n = max(es.num_prefill_steps - n0, 1)
    return {"prompt_steps": es.num_prefill_steps - n0,
            "prompt_step_ms": round(1e3 * (es.prefill_step_s - s0) / n, 4),
            "wall_ms_per_prompt_step": round(1e3 * wall / n, 4),
            "host_phase_ms": {k: round(1e3 * (v - p0.get(k, 0.0)) / n, 4)
                              for k, v in es.prompt_host_phase_s.items()},
            "tokens": tokens}


def _head_ab(llm: Any, prompts: list[list[int]], batch: int, rounds: int) -> dict[str, Any]:
    """Prompt-step ms with the heads written after the host's wait (off) and during it (on),
    ``rounds`` of each in turn on one engine; the same tokens both ways."""
    ph = llm.engine.runner.prompt_head
    out: dict[str, Any] = {"off": [], "on": [], "same_tokens": True}
    ref = None
    for _ in range(rounds):
        for mode in ("off", "on"):
            ph.enabled = mode == "on"
            r = _prompt_steps(llm, prompts, batch)
            out[mode].append(r["prompt_step_ms"])
            out[f"{mode}_propose_ms"] = r["host_phase_ms"].get("propose")
            out[f"{mode}_wait_ms"] = r["host_phase_ms"].get("wait")
            ref = ref or r["tokens"]
            out["same_tokens"] &= r["tokens"] == ref
    ph.enabled = True
    out["stats"] = llm.stats.prompt_head.as_dict()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompts", required=True, help="MT-bench question.jsonl")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--variants", nargs="+", default=["vanilla", "eagle", "adaptive"])
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("--trace-dir", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--head-ab", type=int, default=0, help="rounds of prompt heads off / on")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from compiled_spec.bench.prompts import encode_chat, load_mt_bench
    from compiled_spec.profile import trace_calls
    from compiled_spec.profile_run import host_profile
    from compiled_spec.tokenizer import load_tokenizer

    model, head = random_pair("prompt_step_")
    prompts = encode_chat(load_tokenizer(a.tokenizer), load_mt_bench(a.prompts, a.num_prompts))
    result: dict[str, Any] = {"batch": a.batch, "prompts": len(prompts),
                              "prompt_lens": [len(p) for p in prompts]}
    for v in a.variants:
        t0 = time.perf_counter()
        llm = _engine(v, model, head, a.tokenizer, a.batch, a.device)
        startup = time.perf_counter() - t0
        print(f"== {v}: start-up {startup:.1f} s", flush=True)
        _run(llm, prompts[:2 * a.batch], a.batch, 4)  # warm: first launches per shape
        row = _prompt_steps(llm, prompts, a.batch)
        row["again"] = _prompt_steps(llm, prompts, a.batch)
        row["startup_s"] = round(startup, 2)
        g = llm.compile_stats.get("cuda_graphs", {}) if llm.compiled_active else {}
        row["without_graph"] = g.get("without_graph", g.get("off"))
        # the draft's prompt graphs (engine/draft_prefill_graph.py) and first-pass graphs
        row["draft_graphs"] = {
            n: {k: c.get(k) for k in ("graph_replays", "padded_rows", "fallback_reasons",
                                      "capture_failures", "capture_s")}
            for n, c in g.get("components", {}).items() if n.startswith("draft_")}
        if "vanilla" in result:  # greedy: the same first two tokens as vanilla's
            ref = result["vanilla"]["tokens"]
            row["same_as_vanilla"] = sum(a == b for a, b in zip(row["tokens"], ref)) / len(ref)
        print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
        if a.head_ab and v != "vanilla":
            row["head_ab"] = _head_ab(llm, prompts, a.batch, a.head_ab)
            print(f"{v} prompt heads off / on, ms per prompt step: {row['head_ab']}", flush=True)
        host_profile(lambda: _run(llm, prompts, a.batch, 2), llm, a.rows,
                     count=lambda: llm.stats.num_prefill_steps,
                     label="prompt steps (each with one decode step after it)",
                     by=("own", "cumulative"))
        if a.trace_dir:
            trace = trace_calls(llm, lambda: _run(llm, prompts[:4 * a.batch], a.batch, 2),
                                Path(a.trace_dir) / v, table_rows=25)
            row["trace"] = trace
        result[v] = row
        Path(a.out).write_text(json.dumps(result, indent=1))
        del llm
        import gc
        import torch
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
