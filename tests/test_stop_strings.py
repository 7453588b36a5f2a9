"""Stop strings: text-level, exact under speculation (a draft accepted after the stop is
dropped), the returned text ends before the stop string, the ids keep the token that
completed it."""
import pytest

from compiled_spec import LLM, SamplingParams
from tests.spec_models import write_bigram_target, write_mirror_eagle1

PROMPT = [3, 17, 5, 9]


@pytest.fixture(scope="module")
def models(tmp_path_factory, bigram_eagle3):
    root = tmp_path_factory.mktemp("stop")
    target = write_bigram_target(root / "target", layers=2)
    return {"vanilla": (target, {}),
            "eagle1-mirror": (target, dict(draft=write_mirror_eagle1(root / "mirror", target),
                                           num_speculative_tokens=4)),
            "eagle3": (bigram_eagle3[0], dict(draft=bigram_eagle3[1], num_speculative_tokens=3))}


def test_stop_validation():
    assert SamplingParams(stop="ab").stop == ["ab"] and SamplingParams(stop=None).stop == []
    for bad in ([""], 5, ["a", 3]):
        with pytest.raises(ValueError, match="SamplingParams.stop"):
            SamplingParams(stop=bad)


def test_detokenize_false_gives_the_same_ids_and_no_text(tmp_path, smollm2_gguf_path):
    """Token ids only: the same ids, empty text, and the tokenizer is never called (what
    self-distillation saves); stop strings, matched on text, refuse it."""
    with pytest.raises(ValueError, match="SamplingParams.detokenize=False: stop strings"):
        SamplingParams(stop="ab", detokenize=False)
    llm = LLM(model=write_bigram_target(tmp_path / "target", layers=2),
              tokenizer=smollm2_gguf_path, max_model_len=64)
    sp = dict(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True)
    full = llm.generate([PROMPT, [7, 8]], SamplingParams(**sp))
    assert all(o.text for o in full)

    def refuse(ids, skip):  # noqa: ARG001
        raise AssertionError("detokenized with detokenize=False")
    llm.engine.detokenize = refuse
    ids_only = llm.generate([PROMPT, [7, 8]], SamplingParams(detokenize=False, **sp))
    assert [o.token_ids for o in ids_only] == [o.token_ids for o in full]
    assert [o.text for o in ids_only] == ["", ""]
    assert [o.finish_reason for o in ids_only] == [o.finish_reason for o in full]


@pytest.mark.parametrize("kind", ["vanilla", "eagle1-mirror", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_stop_string_is_exact(models, smollm2_gguf_path, kind, temperature):
    target, kw = models[kind]
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, **kw)
    sp = dict(max_tokens=30, temperature=temperature, seed=4, ignore_eos=True)
    free = llm.generate([PROMPT], SamplingParams(**sp))[0]
    dec = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    text = dec(free.token_ids)
    assert len(text) >= 6, text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # inside the output: the rest is dropped
    m = next(m for m in range(1, len(free.token_ids) + 1) if stop in dec(free.token_ids[:m]))
    for stops in ([stop], ["\x00never", stop]):
        out = llm.generate([PROMPT], SamplingParams(stop=stops, **sp))[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == free.token_ids[:m]
        assert out.text == dec(free.token_ids[:m])[:dec(free.token_ids[:m]).index(stop)]
    # In a batch, beside requests without stop strings, nothing changes.
    outs = llm.generate([PROMPT, [7, 8]], [SamplingParams(stop=stop, **sp), SamplingParams(**sp)])
    assert outs[0].token_ids == free.token_ids[:m] and len(outs[1].token_ids) == 30
    a = llm.engine.allocator
    assert a.num_free == a.num_blocks
