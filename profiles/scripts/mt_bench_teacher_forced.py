"""Issue 14: a head's MT-bench acceptance in the engine beside its teacher-forced accuracy on
the very same answers, so a gap between the trainer's figures and MT-bench tau can be told
apart: an inference mismatch (the engine drafts differently from training) or the data.

    python profiles/scripts/mt_bench_teacher_forced.py --model M.gguf --head smollm2-eagle3 \
        --num-prompts 80 --max-tokens 256 --out /tmp/mt_val.jsonl

Greedy answers with speculation (lossless: vanilla's answers) are written as training
sequences, then scored by ``eval_head_val.py`` (per TTT step, per position). CPU: fp32.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.bench import load_mt_bench, mt_bench_prompts  # noqa: E402
from compiled_spec.data import mt_bench_path  # noqa: E402
from compiled_spec.train.data import TrainSequence, save_sequences  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--head", default="smollm2-eagle3")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on a CPU")
    ap.add_argument("--out", required=True, help="where the answers go (sequences JSONL)")
    a = ap.parse_args()
    dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    texts = load_mt_bench(str(mt_bench_path()), a.num_prompts)
    llm = LLM(model=a.model, draft=a.head, num_speculative_tokens=a.k, device=a.device,
              speculation_policy="always",
              dtype=dtype, max_num_seqs=len(texts), max_model_len=2048)
    prompts = mt_bench_prompts(llm, texts)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0.0))
    st = llm.stats.spec
    per_pos = " ".join(f"{x:.3f}" for x in st.acceptance_rate_per_position or [])
    print(f"engine: tau {st.mean_acceptance_length:.3f}, acceptance per drafting step and "
          f"position [{per_pos}] ({time.perf_counter() - t0:.1f} s)", flush=True)
    seqs = [TrainSequence(f"mt{i}", list(p) + list(o.token_ids), len(p), None, "prose")
            for i, (p, o) in enumerate(zip(prompts, outs))]
    save_sequences(Path(a.out), seqs)
    copy = [c for s in seqs for c in s.copyable()[s.num_prompt:]]
    print(f"reply tokens a context lookup predicts: {sum(copy) / len(copy):.3f}", flush=True)
    del llm
    # The trainer's held-out evaluation on the same answers (its own process: a fresh target).
    return subprocess.call([sys.executable, str(Path(__file__).with_name("eval_head_val.py")),
                            "--model", a.model, "--head", a.head, "--val", a.out,
                            "--device", a.device])


if __name__ == "__main__":
    raise SystemExit(main())
