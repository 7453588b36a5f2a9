"""Issue 16: where a start-up of SmolLM2 + the shipped head (compile=True, fp32, CPU) goes, cold
or warm: run it twice on one cache directory (the first run fills it).

    PYTHONPATH=. COMPILED_SPEC_PROGRESS=0 python profiles/scripts/startup_cpu.py /tmp/cache \
        [--precompile] [--tree]

``--precompile``: CompileConfig(precompile=True) (the CUDA default; off on the CPU otherwise),
so a warm run loads the saved callables instead of tracing them. ``--tree``: a draft tree
engine (topk 4, 16 tokens, 5 steps) instead of the chain (k=3).

Prints the constructor's and the first request's seconds (on the CPU graphs compile at first
use), the compile cache's hits / misses and torch's compile timers (``LLM.compile_cache``), the
graphs per compiled callable and the request's acceptance. TORCH_LOGS="dynamo,aot" shows why a
frame restarts or misses the cache.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    t0 = time.perf_counter()
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.compile import CompileConfig
    from compiled_spec.models.gguf_loader import find_default_gguf

    tree = (dict(num_speculative_tokens=5, speculative_topk=4, speculative_num_draft_tokens=16)
            if "--tree" in sys.argv[2:] else {})
    llm = LLM(model=find_default_gguf(), draft="smollm2-eagle3", dtype="float32", device="cpu",
              max_model_len=256, compile=True, **tree,
              compile_config=CompileConfig(cache_dir=sys.argv[1],
                                           precompile="--precompile" in sys.argv[2:]))
    t1 = time.perf_counter()
    llm.generate(["Hello there, how are you?"], SamplingParams(max_tokens=24, ignore_eos=True))
    t2 = time.perf_counter()
    print(json.dumps({"ctor_s": round(t1 - t0, 1), "first_gen_s": round(t2 - t1, 1),
                      "total_s": round(t2 - t0, 1),
                      "startup": {k: round(v, 1) for k, v in llm.startup_s.items()},
                      "cache": llm.compile_cache}))
    print(json.dumps({k: v.get("graphs") for k, v in llm.compile_stats.items()
                      if isinstance(v, dict)}))
    print(llm.stats.spec.as_dict() if llm.stats.spec else None)


if __name__ == "__main__":
    main()
