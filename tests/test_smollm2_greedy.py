"""The real target: our engine's greedy output equals transformers' greedy generate, token for token."""
import pytest
import torch

from compiled_spec import LLM, SamplingParams


@pytest.mark.heavy
def test_greedy_matches_transformers_on_mt_bench(smollm2_gguf_path, smollm2_hf, mt_bench_questions):
    llm = LLM(model=smollm2_gguf_path, dtype="float32", device="cpu", max_model_len=1024, page_size=16)
    # Three prompts of different lengths run together as one continuously batched engine run.
    picks = [mt_bench_questions[i] for i in (0, 7, 12)]
    prompts = [llm.encode_chat([{"role": "user", "content": q}]) for q in picks]
    assert len({len(p) for p in prompts}) == 3
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    ours = llm.generate(prompts, sp)
    for ids, out in zip(prompts, ours):
        with torch.inference_mode():
            ref = smollm2_hf.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64,
                                      do_sample=False)[0, len(ids):].tolist()
        assert out.token_ids == ref, (
            f"first divergence at token {next(i for i, (a, b) in enumerate(zip(out.token_ids, ref)) if a != b)}")
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks
