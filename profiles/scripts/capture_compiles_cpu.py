"""Issue 16: the compiles behind a chain engine's start-up, on the CPU. SmolLM2 + the shipped
head (k = 5, fp32) compiled (Inductor unless the second argument is 0) and captured as emulated
CUDA graphs (``capture.emulate``) for the given batch sizes: the seconds that takes and the
graphs each compiled callable ended with (each one a Dynamo trace + AOTAutograd + Inductor).

    TORCHINDUCTOR_CACHE_DIR=/tmp/cc PYTHONPATH=. COMPILED_SPEC_PROGRESS=0 \\
        python profiles/scripts/capture_compiles_cpu.py 1 1     # batch sizes "1", Inductor on
    ... capture_compiles_cpu.py 1 1 1   # third argument 1: CompileConfig(precompile=True)
    ... capture_compiles_cpu.py 1 0 0 0 # fourth argument 0: CompileConfig(size_oblivious=False)

Run it twice on one cache directory for cold and warm.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    from capture import CapturePolicy
    from compiled_spec import LLM
    from compiled_spec.compile import CompileConfig, capture_graphs, compile_models, use_compiled
    from compiled_spec.models.gguf_loader import find_default_gguf

    sizes = tuple(int(x) for x in sys.argv[1].split(","))
    inductor = len(sys.argv) < 3 or sys.argv[2] != "0"
    precompile = len(sys.argv) > 3 and sys.argv[3] == "1"
    oblivious = len(sys.argv) < 5 or sys.argv[4] != "0"
    llm = LLM(model=find_default_gguf(), draft="smollm2-eagle3", dtype="float32", device="cpu",
              max_model_len=256, max_num_seqs=max(sizes), num_speculative_tokens=5)
    models = compile_models(llm.engine.runner, CompileConfig(
        inductor=inductor, precompile=precompile, size_oblivious=oblivious))
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=max(sizes), num_speculative_tokens=5,
                           max_model_len=256, batch_sizes=sizes)
    t0 = time.perf_counter()
    use_compiled(llm.engine.runner, models, True)
    capture_graphs(llm.engine.runner, models, policy, llm.config.cache.page_size, emulate=True)
    print(json.dumps({"batch_sizes": sizes, "inductor": inductor, "size_oblivious": oblivious,
                      "compile_and_capture_s": round(time.perf_counter() - t0, 1),
                      "graphs": {k: len(b.graphs) for k, b in models.backends.items()},
                      "precompile": models.precompile and models.precompile.as_dict()}))


if __name__ == "__main__":
    main()
