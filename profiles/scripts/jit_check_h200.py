"""Issue 4/6 on a GPU: after start-up, prefills of new prompt lengths compile no Triton kernel.

The vanilla compiled benchmark paid ~0.19 s per request at batch 1 that the EAGLE-3 engine run
after it in the same process did not (H200, 2026-11-30): new prefill lengths JIT-compiled new
attention launch configurations. ``kernels.warmup`` now compiles every reachable configuration
at start-up; this counts the attention kernels' compiled binaries before and after 24 prompts of
new lengths, and times each request's prefill.

python profiles/scripts/jit_check_h200.py [--model ~/m/model.gguf]
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from kernels import attention_triton as at  # noqa: E402


def binaries() -> int:
    """Compiled binaries of the attention kernels (Triton keeps them per device: the first
    entry of each device cache maps a specialisation key to its kernel)."""
    return sum(len(c[0]) for k in (at._paged_attn_kernel, at._merge_splits_kernel)
               for c in k.device_caches.values())


ap = argparse.ArgumentParser()
ap.add_argument("--model", default=os.path.expanduser("~/m/model.gguf"))
a = ap.parse_args()
t0 = time.perf_counter()
llm = LLM(model=a.model, device="cuda", dtype="bfloat16", compile=True, max_model_len=2048,
          max_num_seqs=4)
start = time.perf_counter() - t0
warm = llm.engine.kernel_warmup
before = binaries()
sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
ttft = []
for n in [5 + 37 * i for i in range(24)]:  # 5 .. 856 prompt tokens
    t = time.perf_counter()
    llm.generate([[100 + (j % 1000) for j in range(n)]], sp)
    ttft.append(round(1e3 * (time.perf_counter() - t), 2))
print(json.dumps({"startup_s": round(start, 1), "kernel_warmup": warm,
                  "attention_binaries_before": before, "after": binaries(),
                  "request_ms_by_prompt_len": ttft}))
