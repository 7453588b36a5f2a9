"""One rank of ``LLM(tensor_parallel_size=2)`` under torchrun (tests/test_tensor_parallel.py):
torch.distributed is initialised here, so ``LLM`` launches nothing and is this rank's shard.

python -m torch.distributed.run --standalone --nproc-per-node 2 tests/torchrun_worker.py \
    TARGET HEAD TOKENIZER OUT_DIR
"""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiled_spec import LLM, SamplingParams  # noqa: E402

PROMPTS = [[3, 7, 1], [9, 2, 4, 4, 8, 1, 2]]
PARAMS = [SamplingParams(max_tokens=16, temperature=t, seed=s, ignore_eos=True)
          for t, s in ((0.0, 0), (0.9, 4))]

if __name__ == "__main__":
    target, head, tokenizer, out = sys.argv[1:5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    llm = LLM(model=target, tokenizer=tokenizer, device="cpu", max_model_len=128, draft=head,
              num_speculative_tokens=3, tensor_parallel_size=2)
    outs = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    Path(out, f"torchrun_rank{dist.get_rank()}.json").write_text(json.dumps(
        {"tokens": outs, "drafting_steps": llm.stats.spec.num_drafting_steps}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's teardown at interpreter exit aborts now and then (see the launcher)
