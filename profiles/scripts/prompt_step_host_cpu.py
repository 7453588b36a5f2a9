"""Issue 16: the host side of an EAGLE-3 engine's prompt steps at batch 64, on the CPU.

On the H100 (results/2026-12-07_h100_session51/prompt_step_b64_after.log.gz) an EAGLE-3 prompt
step of 64 MT-bench prompts (~1,500 prompt rows) cost ~8.7 ms against vanilla's ~4.9 ms, with
no graph missed: the difference is host Python over the prompt rows. The host side runs the
same code on any device, so it is measured here with a tiny target (vocab 512, hidden 32,
3 layers, attention returning zeros) and a random EAGLE-3 head, compiled over our passes (no
Inductor) and routed through emulated CUDA graphs captured by the engine's own policy
(``engine_capture_policy``: the batch, prompt and mixed sizes a GPU engine captures).

Per variant (vanilla, EAGLE-3 k = 5): ``generate(max_tokens=2)`` over rounds of B prompts of
12-40 tokens; the engine's prompt-step ms and host phases (engine/host_clock.py), minus the
model's CPU compute (emulated replays and compiled calls, timed and printed beside); then a
cProfile of the same by own time per prompt step. The "tokens" digest must not change when
the host code is optimised.

.venv/bin/python profiles/scripts/prompt_step_host_cpu.py [--batch 64] [--rounds 6] [--cprofile]
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# (importing it replaces paged attention by zeros and times emulated replays into _MODEL_S)
from profiles.scripts.host_large_batch_cpu import _MODEL_S, tokenizer_dir  # noqa: E402
from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.compile import CompileConfig, capture_graphs, compile_models  # noqa: E402
from compiled_spec.llm_compile import engine_capture_policy  # noqa: E402


def tiny_pair() -> tuple[str, str, str]:
    """(target, EAGLE-3 head, tokenizer): a bigram target of vocab 512, hidden 32, 3 layers
    and a random head for it, written to a temporary directory."""
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.config import ModelConfig
    from tests.spec_models import write_bigram_target

    tmp = Path(tempfile.mkdtemp())
    target = write_bigram_target(tmp / "target", vocab=512, hidden=32, layers=3)
    head = write_eagle3_head(str(tmp / "head"), ModelConfig.from_hf_dict(
        json.loads((tmp / "target" / "config.json").read_text())), draft_vocab_size=256)
    return target, head, tokenizer_dir()


def _engine(variant: str, target: str, head: str, tok: str, batch: int,
            policy: str = "always", sizes: tuple[int, ...] | None = None) -> LLM:
    """``sizes``: the graphs' batch sizes (default: ``batch`` alone)."""
    kw = dict(model=target, tokenizer=tok, dtype="float32", max_model_len=256,
              max_num_seqs=batch, kv_cache_memory_gib=0.5, verify_ahead=True)  # (as on CUDA)
    if variant != "vanilla":
        kw.update(draft=head, num_speculative_tokens=5, speculation_policy=policy)
    llm = LLM(**kw)
    runner = llm.engine.runner
    cc = CompileConfig(inductor=False, capture_batch_sizes=sizes or (batch,))
    models = compile_models(runner, cc)
    llm._compiled = models
    policy = engine_capture_policy(cc, llm.config)
    capture_graphs(runner, models, policy, llm.config.cache.page_size, emulate=True)
    return llm


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 511) for _ in range(rng.randint(12, 40))] for _ in range(n)]


def _rounds(llm: LLM, batch: int, rounds: int, seed: int) -> tuple[dict, str]:
    es = llm.stats
    n0, s0, p0 = es.num_prefill_steps, es.prefill_step_s, dict(es.prompt_host_phase_s)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    toks = []
    _MODEL_S[0] = 0.0
    for r in range(rounds):
        outs = llm.generate(_prompts(batch, seed + r), sp, use_tqdm=False)
        toks += [o.outputs[0].token_ids for o in outs]
    n = max(es.num_prefill_steps - n0, 1)
    row = {"prompt_steps": es.num_prefill_steps - n0,
           "prompt_step_ms": round(1e3 * (es.prefill_step_s - s0) / n, 3),
           "model_ms_all_steps": round(1e3 * _MODEL_S[0] / n, 3),
           "host_phase_ms": {k: round(1e3 * (v - p0.get(k, 0.0)) / n, 3)
                             for k, v in es.prompt_host_phase_s.items()}}
    return row, hashlib.sha1(repr(toks).encode()).hexdigest()[:12]


def host_args(variants: list[str]) -> argparse.ArgumentParser:
    """The options these CPU host harnesses share."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--variants", nargs="+", default=variants)
    ap.add_argument("--cprofile", action="store_true", help="top functions by own time")
    ap.add_argument("--top", type=int, default=30)
    return ap


def main() -> None:
    ap = host_args(["vanilla", "eagle"])
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    torch.set_num_threads(1)
    target, head, tok = tiny_pair()
    for v in a.variants:
        llm = _engine(v, target, head, tok, a.batch)
        _rounds(llm, a.batch, 2, 1000)  # warm: Dynamo guards, first replays
        row, digest = _rounds(llm, a.batch, a.rounds, 0)
        print(v, json.dumps(row), "tokens", digest, flush=True)
        if a.cprofile:
            prof = cProfile.Profile()
            steps0 = llm.stats.num_prefill_steps
            prof.enable()
            _rounds(llm, a.batch, a.rounds, 0)
            prof.disable()
            n = llm.stats.num_prefill_steps - steps0
            print(f"-- {v}: cProfile over {n} prompt steps (their decode steps included)")
            st = pstats.Stats(prof)
            st.sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()
