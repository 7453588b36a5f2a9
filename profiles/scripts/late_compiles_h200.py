"""What a warm engine still compiles while serving, and what each prompt step costs.

Session 21 (H200): the first engine of a bench process (the EAGLE-3 chain) had one prompt step
of 524 ms among ten of ~23 ms; engines built later in the same process had none. This probe then
found a fresh engine's first request at 25.3 s (Dynamo compiling the prompt-step shapes) and
Triton JIT-compiling attention kernels in three of twelve requests (pointer alignment of the
metadata views); start-up's dummy requests and aligned views answer both. This builds an
engine as the bench does (compiled + graphs, bf16, batch 1), runs MT-bench prompts one at a
time and prints, per request: its prompt step's time, Dynamo frames compiled, Triton JIT
compiles (kernel names, through Triton's post-compile hook) and the step's share of either.

python profiles/scripts/late_compiles_h200.py --model ~/m/model.gguf [--draft smollm2-eagle3]
    [--num-prompts 12] [--out late.json]
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.bench.prompts import encode_chat, load_mt_bench  # noqa: E402
from compiled_spec.data import mt_bench_path  # noqa: E402
from compiled_spec.tokenizer import load_tokenizer  # noqa: E402

JIT: list[str] = []


def _hook(*args, **kwargs) -> bool:  # noqa: ANN002, ANN003 - Triton's hook signature varies
    fn = kwargs.get("fn")
    name = getattr(fn, "name", None) or getattr(getattr(fn, "jit_function", None), "__name__",
                                                 repr(fn))
    JIT.append(f"{name}{' (cached)' if kwargs.get('already_compiled') else ''}")
    return False


def _frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser("~/m/model.gguf"))
    ap.add_argument("--draft", default="smollm2-eagle3", help="'' for vanilla")
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--prompts", default=str(mt_bench_path()))
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (eager)")
    a = ap.parse_args()
    try:
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = _hook
        hooked = True
    except (ImportError, AttributeError):
        hooked = False
    t0 = time.perf_counter()
    kw = dict(draft=a.draft, num_speculative_tokens=a.k) if a.draft else {}
    cuda = a.device == "cuda"
    llm = LLM(model=a.model, device=a.device, dtype="bfloat16" if cuda else "float32",
              compile=cuda, max_model_len=2048, max_num_seqs=1, **kw)
    startup = time.perf_counter() - t0
    prompts = encode_chat(load_tokenizer(a.model), load_mt_bench(a.prompts, a.num_prompts))
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    rows = []
    JIT.clear()
    for i, p in enumerate(prompts):
        f0, j0 = _frames(), len(JIT)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate([p], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        st = llm.stats
        rows.append(dict(i=i, prompt_len=len(p), wall_ms=round(1e3 * wall, 1),
                         prompt_step_ms=round(1e3 * st.recent_prefill_step_s[-1], 2),
                         dynamo_frames=_frames() - f0, triton_jit=JIT[j0:]))
        print(json.dumps(rows[-1]), flush=True)
    res = dict(startup_s=round(startup, 1), startup_split_s={k: round(v, 2) for k, v in
                                                              llm.startup_s.items()},
               compiled_after_startup=llm.compile_stats.get("compiled_after_startup", {}),
               triton_hook=hooked, rows=rows)
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
