"""Issue 9 on the nvidia-h200-x2 machine: tensor parallelism 1 vs 2 for the Llama-3.1-8B shape.

python profiles/scripts/tp_h200.py --tokenizer ~/m/model.gguf --out tp.json [--tp 1 2] [--batch 1 16]

Random weights (`random:` target of the 8B config, seeded, identical on every rank) and a random
EAGLE-3 head of its shape (32k draft vocabulary, replicated on every rank): drafts are almost
never accepted (tau ~ 1), so the EAGLE rows are the cost of speculating, not a speedup; the
per-step figures are what carry over to a trained head. compile=True with CUDA graphs (the
collectives are captured inside them), bf16, 128-token random prompts, 128 new tokens, greedy.
Per configuration: start-up, output tokens/s, decode ms per token (median over requests), tau.
NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends are kept / set, see the device notes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # before torch / NCCL start; inherited by the TP workers

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.bench.run import LLAMA8B, TINY, _random_shape  # noqa: E402
from compiled_spec.compile import CompileConfig  # noqa: E402


def run(target: str, head: str | None, tp: int, batches: list[int], tokenizer: str,
        max_tokens: int, device: str, shard_draft: bool = False) -> list[dict]:
    t0 = time.perf_counter()
    gpu = device == "cuda"
    kw = dict(model=target, tokenizer=tokenizer, device=device,
              dtype="bfloat16" if gpu else "float32", max_model_len=1024,
              max_num_seqs=max(batches), kv_cache_memory_gib=8 if gpu else 0.25,
              tensor_parallel_size=tp, compile=True,
              compile_config=CompileConfig(capture_batch_sizes=tuple(sorted(set(batches)))))
    if head is not None:
        kw.update(draft=head, method="eagle3", num_speculative_tokens=3)
        if tp > 1:
            kw["draft_tensor_parallel"] = shard_draft
    llm = LLM(**kw)
    startup = time.perf_counter() - t0
    g = __import__("random").Random(0)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for b in batches:
        prompts = [[g.randrange(1000, 40000) for _ in range(128)] for _ in range(b)]
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        wall = time.perf_counter() - t0
        per_req = [1e3 * (o.metrics.finish_time - o.metrics.first_token_time)
                   / max(1, len(o.outputs[0].token_ids) - 1) for o in outs]
        stats = llm.stats.spec.as_dict() if head is not None else {}
        method = ("eagle3 k=3 (random head" + (", sharded draft)" if shard_draft else ")")
                  if head else "vanilla")
        rows.append({"tp": tp, "method": method,
                     "batch": b, "startup_s": round(startup, 1),
                     "tokens_per_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / wall, 1),
                     "ms_per_token": round(statistics.median(per_req), 3),
                     "tau": stats.get("mean_acceptance_length")})
        print(rows[-1], flush=True)
    llm.shutdown()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", nargs="+", default=["vanilla", "eagle3", "eagle3_sharded"],
                    help="eagle3: draft replicated on every rank; eagle3_sharded: draft sharded "
                         "too (TP > 1 only)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run over gloo (use --shape tiny)")
    ap.add_argument("--shape", choices=["llama8b", "tiny"], default="llama8b")
    a = ap.parse_args()
    import torch

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        target, head = _random_shape(LLAMA8B if a.shape == "llama8b" else TINY, Path(tmp))
        for tp in a.tp:
            for m in a.methods:
                if m == "eagle3_sharded" and tp == 1:
                    continue
                rows += run(target, None if m == "vanilla" else head, tp, a.batch, a.tokenizer,
                            a.max_tokens, a.device, shard_draft=m == "eagle3_sharded")
                Path(a.out).write_text(json.dumps({
                    "gpus": [torch.cuda.get_device_name(i)
                             for i in range(torch.cuda.device_count())],
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                    "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
