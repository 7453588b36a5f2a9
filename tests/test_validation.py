"""Bad input is a ValueError naming the value, before anything runs, and the engine goes on.
Each case here once got through (or failed with another error) somewhere deeper."""
import math

import numpy as np
import pytest

from compiled_spec import SamplingParams


@pytest.mark.parametrize("kw, match", [
    (dict(seed=2 ** 63), "seed"),  # failed in the runner: Overflow when unpacking long long
    (dict(seed=-(2 ** 63) - 1), "seed"),
    (dict(top_k=2 ** 63), "top_k"),
    (dict(top_k=2 ** 31), "top_k"),
    (dict(temperature=math.inf), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=True), "top_p"),
    (dict(min_p=False), "min_p"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(top_k=True), "top_k"),
    (dict(seed=True), "seed"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids="ab"), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"),
])
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_edges_and_numpy_are_accepted():
    sp = SamplingParams(seed=2 ** 63 - 1, top_k=2 ** 31 - 1, stop_token_ids=None)
    assert sp.stop_token_ids == [] and sp.seed == 2 ** 63 - 1
    sp = SamplingParams(seed=np.int64(-5), top_k=np.int32(3), temperature=np.float32(0.5),
                        max_tokens=np.int64(4), stop_token_ids=(np.int64(7),))
    assert type(sp.seed) is int and type(sp.temperature) is float and sp.stop_token_ids == [7]
    assert SamplingParams(seed=-(2 ** 63)).seed == -(2 ** 63)


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smollm2_gguf_path):
    from compiled_spec import LLM
    from tests.spec_models import write_bigram_target

    target = write_bigram_target(tmp_path_factory.mktemp("bigram"), vocab=64, seed=3)
    return LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, page_size=4)


def _free(llm) -> bool:
    a = llm.engine.allocator
    return a.num_free == a.num_blocks and not llm.engine.has_unfinished()


def test_mutated_params_are_rechecked_and_copied(llm):
    sp = SamplingParams(max_tokens=4, temperature=0.0)
    sp.temperature = -1.0
    with pytest.raises(ValueError, match="prompt 0: SamplingParams.temperature=-1.0"):
        llm.generate([[1, 2]], sp)
    sp.temperature, sp.seed = 0.7, 2 ** 64
    with pytest.raises(ValueError, match="seed"):
        llm.generate([[1, 2]], sp)
    sp.seed = 3
    out = llm.generate([[1, 2]], sp)[0]
    assert len(out.token_ids) <= 4 and _free(llm)


def test_prompt_forms(llm):
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    want = llm.generate([[5, 6, 7]], sp)[0].token_ids
    assert [o.token_ids for o in llm.generate((5, 6, 7), sp)] == [want]  # one prompt, not three
    assert [o.token_ids for o in llm.generate(np.array([5, 6, 7]), sp)] == [want]
    assert [o.token_ids for o in llm.generate([np.int64(5), np.int32(6), np.int64(7)], sp)] == [want]
    assert [o.token_ids for o in llm.generate(np.array([[5, 6, 7]] * 2), sp)] == [want] * 2
    assert llm.generate([], sp) == []
    with pytest.raises(ValueError, match="token id True is not an integer"):
        llm.generate([[5, True]], sp)
    with pytest.raises(ValueError, match="token id 64 is outside the vocabulary"):
        llm.generate([[5, 64]], sp)
    with pytest.raises(ValueError, match="prompt 1: a prompt must be a string or a list"):
        llm.generate([[5], 3.5], sp)
    with pytest.raises(ValueError, match="sampling params must be SamplingParams"):
        llm.generate([[5]], {"max_tokens": 3})
    assert _free(llm)
