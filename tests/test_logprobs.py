"""Per-token logprobs: the emitted token's and the top-k under the target's raw distribution,
the same with and without speculation (chain and tree), and equal to a direct forward."""
import math

import pytest
import torch

from compiled_spec import LLM, SamplingParams

PROMPT = [3, 17, 5, 9]


def test_logprobs_validation():
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="SamplingParams.logprobs"):
            SamplingParams(logprobs=bad)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_exact_with_speculation(bigram_eagle3, smollm2_gguf_path, temperature):
    target, head = bigram_eagle3
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, page_size=4)
    sp = SamplingParams(max_tokens=10, temperature=temperature, seed=3, ignore_eos=True,
                        logprobs=3)
    vanilla = LLM(**kw)
    want = vanilla.generate([PROMPT], sp)[0]
    assert len(want.outputs[0].logprobs) == len(want.token_ids) == 10
    # Against transformers' forward over prompt + output: log_softmax of the raw logits.
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([PROMPT + want.token_ids])).logits[0], -1)
    for j, (tok, d) in enumerate(zip(want.token_ids, want.outputs[0].logprobs)):
        row = ref[len(PROMPT) - 1 + j]
        assert tok in d and 3 <= len(d) <= 4
        assert set(row.topk(3).indices.tolist()) <= d.keys()
        assert all(math.isclose(v, row[t].item(), abs_tol=1e-4) for t, v in d.items())
    for extra in (dict(draft=head, num_speculative_tokens=3),
                  dict(draft=head, speculative_topk=2, speculative_num_draft_tokens=6)):
        llm = LLM(**kw, **extra)
        got = llm.generate([PROMPT, [7, 8]], [sp, SamplingParams(max_tokens=10, ignore_eos=True)])
        assert got[0].token_ids == want.token_ids and got[1].outputs[0].logprobs is None
        for a, b in zip(got[0].outputs[0].logprobs, want.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(math.isclose(a[t], b[t], abs_tol=1e-4) for t in a)
