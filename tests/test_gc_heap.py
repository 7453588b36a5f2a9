"""The start-up heap frozen out of Python's full collections, and full collections inside engine
steps counted (compiled_spec/gc_heap.py)."""
from __future__ import annotations

import gc

import pytest
import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.gc_heap import CLOCK, freeze_default, freeze_startup_heap, thaw

PROMPTS = [[3, 7, 1], [5, 9], [9, 2, 4, 4, 8]]


def _llm(target: str, tok: str, head: str, **kw) -> LLM:
    return LLM(model=target, tokenizer=tok, draft=head, num_speculative_tokens=3,
               max_model_len=128, max_num_seqs=4, **kw)


def test_default_is_cuda_only_and_the_env_overrides(monkeypatch):
    monkeypatch.delenv("COMPILED_SPEC_GC_FREEZE", raising=False)
    assert freeze_default(torch.device("cuda")) and not freeze_default(torch.device("cpu"))
    monkeypatch.setenv("COMPILED_SPEC_GC_FREEZE", "1")
    assert freeze_default(torch.device("cpu"))
    monkeypatch.setenv("COMPILED_SPEC_GC_FREEZE", "0")
    assert not freeze_default(torch.device("cuda"))


def test_freeze_takes_the_heap_out_of_full_collections():
    try:
        keep = [[i] for i in range(20000)]  # long-lived objects a full collection would walk
        freeze_startup_heap()
        assert gc.get_freeze_count() >= len(keep)
        before = CLOCK.count
        gc.collect()
        assert CLOCK.count == before + 1  # the clock saw the full collection
        thaw()
        assert gc.get_freeze_count() == 0
    finally:
        thaw()


def test_engine_freezes_when_ready_thaws_at_shutdown_and_output_is_unchanged(
        trained_eagle3_pair, smollm2_gguf_path, monkeypatch):
    target, head = trained_eagle3_pair
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    monkeypatch.setenv("COMPILED_SPEC_GC_FREEZE", "0")
    plain = _llm(target, smollm2_gguf_path, head)
    assert not plain.config.gc_freeze and "gc_freeze" not in plain.startup_s
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, sp, use_tqdm=False)]
    monkeypatch.setenv("COMPILED_SPEC_GC_FREEZE", "1")
    try:
        llm = _llm(target, smollm2_gguf_path, head)
        assert llm.config.gc_freeze and "gc_freeze" in llm.startup_s
        assert gc.get_freeze_count() > 0
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        assert got == want
        llm.shutdown()
        assert gc.get_freeze_count() == 0
    finally:
        thaw()


def test_a_full_collection_inside_a_step_is_counted(trained_eagle3_pair, smollm2_gguf_path):
    target, head = trained_eagle3_pair
    llm = _llm(target, smollm2_gguf_path, head, speculation_policy="adaptive")
    runner = llm.engine.runner
    execute, calls = runner.execute, [0]

    def execute_with_a_pause(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            gc.collect()  # what Python's own thresholds start at some step of a long run
        return execute(*args, **kwargs)

    runner.execute = execute_with_a_pause
    llm.generate(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    st = llm.stats
    assert st.gc_full_collections == 1
    assert 0 < st.gc_full_max_s <= st.gc_full_s


@pytest.mark.parametrize("env", ["0", "1"])
def test_compiled_engine_freezes_after_capture(trained_eagle3_pair, smollm2_gguf_path,
                                               monkeypatch, env):
    """compile=True: the heap is frozen once compilation is done (what it made is most of it)."""
    from compiled_spec.compile import CompileConfig

    target, head = trained_eagle3_pair
    monkeypatch.setenv("COMPILED_SPEC_GC_FREEZE", env)
    try:
        llm = _llm(target, smollm2_gguf_path, head, compile=True,
                   compile_config=CompileConfig(inductor=False))
        assert ("gc_freeze" in llm.startup_s) == (env == "1")
        assert (gc.get_freeze_count() > 0) == (env == "1")
    finally:
        thaw()
