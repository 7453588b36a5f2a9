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
    (dict(detokenize=0), "detokenize"),
    (dict(stop=["x"], detokenize=False), "detokenize"),  # stop strings are matched on text
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


def test_engine_keeps_an_independent_checked_copy(llm):
    """add_request validates once, on the copy it keeps: numpy scalars normalised there, the
    caller's lists not shared, a bad field or prompt named, the caller's object untouched."""
    stop_ids = [np.int64(9)]
    sp = SamplingParams(max_tokens=3, temperature=0.5, top_k=5, seed=1, stop_token_ids=stop_ids,
                        stop=["zz"])
    sp.top_k, sp.top_p, sp.max_tokens = np.int32(4), np.float32(0.5), np.int64(3)
    eng = llm.engine
    rid = eng.add_request([1, 2], sp)
    kept = next(r for r in eng.scheduler.waiting if r.req_id == rid).params
    assert kept is not sp and kept.stop_token_ids is not sp.stop_token_ids
    assert kept.stop is not sp.stop and kept.stop == ["zz"] and kept.stop_token_ids == [9]
    assert type(kept.top_k) is int and type(kept.top_p) is float and type(kept.max_tokens) is int
    assert type(sp.top_k) is np.int32  # the caller's object is not normalised behind its back
    sp.stop_token_ids.append(11)
    sp.stop.append("yy")
    assert kept.stop_token_ids == [9] and kept.stop == ["zz"]
    while eng.has_unfinished():
        eng.step()
    bad = SamplingParams(max_tokens=2)
    bad.top_p = 0.0
    with pytest.raises(ValueError, match="SamplingParams.top_p=0.0"):
        eng.add_request([1, 2], bad)
    with pytest.raises(ValueError, match="sampling params must be SamplingParams, got dict"):
        eng.add_request([1, 2], {"max_tokens": 2})
    with pytest.raises(ValueError, match="token id 64 is outside the vocabulary"):
        eng.add_request([1, 64], SamplingParams(max_tokens=2))
    assert _free(llm)


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
    with pytest.raises(ValueError, match="token id -1 is outside the vocabulary"):
        llm.generate([[5, -1, 7]], sp)
    with pytest.raises(ValueError, match="token id 6.0 is not an integer"):
        llm.generate([[5, 6.0]], sp)
    ids = [5, 6, 7]  # the engine keeps its own copy of a checked prompt
    assert llm.engine.check_request(ids, sp) == ids and llm.engine.check_request(ids, sp) is not ids
    with pytest.raises(ValueError, match="prompt 1: a prompt must be a string or a list"):
        llm.generate([[5], 3.5], sp)
    with pytest.raises(ValueError, match="sampling params must be SamplingParams"):
        llm.generate([[5]], {"max_tokens": 3})
    assert _free(llm)


def test_truncated_checkpoints_name_the_file(tmp_path, smollm2_gguf_path, capsys):
    import shutil

    from compiled_spec import LLM
    from compiled_spec.cli import main
    from tests.spec_models import write_bigram_target

    d = tmp_path / "trunc"
    write_bigram_target(d, vocab=64)
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{st}: cannot read this checkpoint file .*Safetensor"):
        LLM(model=str(d), tokenizer=smollm2_gguf_path)
    g = tmp_path / "trunc.gguf"
    with open(smollm2_gguf_path, "rb") as f:
        g.write_bytes(f.read(200_000))
    with pytest.raises(ValueError, match=f"{g}: cannot read this GGUF file"):
        LLM(model=str(g))
    # The CLI says so in one line instead of a traceback.
    capsys.readouterr()  # the checkpoint writer's progress bar
    assert main(["generate", "--model", str(d), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compiled-spec: error: ") and "Traceback" not in err and str(st) in err
    shutil.rmtree(d)


def test_chat_message_without_content(llm):
    with pytest.raises(ValueError, match="message 1 .*'content' must be a string"):
        llm.chat([{"role": "user", "content": "hi"}, {"role": "assistant"}])
    with pytest.raises(ValueError, match="message 0 must be a dict"):
        llm.chat([["user", "hi"]])


def test_tp_shapes_refused_before_workers_start(tmp_path, monkeypatch):
    import compiled_spec.distributed.launcher as launcher
    from compiled_spec import LLM
    from tests.spec_models import write_bigram_target

    def no_workers(*a, **k):
        raise AssertionError("workers started before the shape check")

    monkeypatch.setattr(launcher, "TPLauncher", no_workers)
    target = write_bigram_target(tmp_path / "t", vocab=64)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by "
                                         "tensor_parallel_size=3"):
        LLM(model=target, tensor_parallel_size=3)


def test_kv_pool_larger_than_memory_is_refused(tmp_path, smollm2_gguf_path):
    import torch

    from compiled_spec import LLM
    from compiled_spec.memory import available_bytes, check_kv_pool_fits
    from tests.spec_models import write_bigram_target

    assert available_bytes(torch.device("cpu")) > 0
    with pytest.raises(ValueError, match="num_kv_blocks=7: .* 7 blocks x 1024 bytes"):
        check_kv_pool_fits(7, 1024, torch.device("cpu"), "num_kv_blocks=7", available=4096)
    check_kv_pool_fits(4, 1024, torch.device("cpu"), "num_kv_blocks=4", available=4096)
    target = write_bigram_target(tmp_path / "t", vocab=64)
    with pytest.raises(ValueError, match="num_kv_blocks=1000000000000: the KV cache needs"):
        LLM(model=target, tokenizer=smollm2_gguf_path, num_kv_blocks=10 ** 12)
    with pytest.raises(ValueError, match="kv_cache_memory_gib=1000000.0: the KV cache needs"):
        LLM(model=target, tokenizer=smollm2_gguf_path, kv_cache_memory_gib=1e6)
    with pytest.raises(ValueError, match="kv_cache_memory_gib=inf"):
        LLM(model=target, tokenizer=smollm2_gguf_path, kv_cache_memory_gib=float("inf"))
