"""n > 1: one RequestOutput per prompt with n completions, each its own request with a seed
derived from the prompt's (completion 0 keeps it), exact under speculation."""
import pytest

from compiled_spec import LLM, SamplingParams
from compiled_spec.sampling_params import sub_seed


def test_n_validation_and_seeds():
    for bad in (0, -1, True, 1.5, 1025):
        with pytest.raises(ValueError, match="SamplingParams.n"):
            SamplingParams(n=bad)
    seeds = [sub_seed(2 ** 63 - 1, i) for i in range(50)] + [sub_seed(-5, i) for i in range(50)]
    assert all(-(2 ** 63) <= s < 2 ** 63 for s in seeds) and len(set(seeds)) == 100
    assert sub_seed(7, 0) == 7 and sub_seed(None, 3) is None


@pytest.mark.parametrize("spec", [False, True])
def test_n_completions(bigram_eagle3, smollm2_gguf_path, spec):
    target, head = bigram_eagle3
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, page_size=4)
    llm = LLM(**kw, **(dict(draft=head, num_speculative_tokens=3) if spec else {}))
    base = dict(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    outs = llm.generate([[1, 2, 3], [4, 5]], [SamplingParams(n=3, **base),
                                              SamplingParams(**base)])
    assert len(outs) == 2 and len(outs[0].outputs) == 3 and len(outs[1].outputs) == 1
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    for i, comp in enumerate(outs[0].outputs):  # each completion = that seed run alone
        alone = llm.generate([[1, 2, 3]], SamplingParams(**{**base, "seed": sub_seed(11, i)}))[0]
        assert comp.token_ids == alone.token_ids and comp.finish_reason == "length"
    assert len({tuple(c.token_ids) for c in outs[0].outputs}) > 1  # different samples
    if spec:  # speculation exact: the vanilla engine gives the same completions
        vanilla = LLM(**kw).generate([[1, 2, 3]], SamplingParams(n=3, **base))[0]
        assert [c.token_ids for c in vanilla.outputs] == [c.token_ids for c in outs[0].outputs]
    a = llm.engine.allocator
    assert a.num_free == a.num_blocks and not llm.engine.has_unfinished()
