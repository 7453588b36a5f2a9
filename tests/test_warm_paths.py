"""Start-up's dummy requests (compiled_spec/engine/warm_paths.py): after them, no request
compiles a graph (prompt steps run the compiled callables outside the captured graphs), the
counters users read start from zero, and outputs stay those of vanilla decoding. CPU, with
emulated graphs over our passes (no Inductor)."""
from __future__ import annotations

import pytest

from compiled_spec import LLM, SamplingParams
from compiled_spec.engine.warm_paths import warm_requests, warm_uncaptured_paths
from tests.engine_runs import with_emulated_graphs

K = 3


def _user_traffic(llm: LLM) -> list[list[int]]:
    """One request alone, a batch of three of new lengths (one sampled), then five at most four
    at a time (prompts admitted beside running requests)."""
    sp = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    out = [o.outputs[0].token_ids for o in llm.generate([[4, 9, 2, 7, 7, 1, 3, 5, 8]], sp,
                                                         use_tqdm=False)]
    batch = [[5, 1, 2], [6] * 23, [9, 3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]
    out += [o.outputs[0].token_ids for o in llm.generate(batch, sp, use_tqdm=False)]
    sampled = SamplingParams(max_tokens=7, temperature=0.7, seed=5, ignore_eos=True)
    llm.generate([[2, 2, 3]], sampled, use_tqdm=False)
    more = [[7 + i] * (3 + 4 * i) for i in range(5)]
    budgets = [SamplingParams(max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True)
               for i in range(5)]
    out += [o.outputs[0].token_ids for o in llm.generate(more, budgets, use_tqdm=False)]
    return out


@pytest.fixture(scope="module")
def vanilla_out(bigram_eagle3, smollm2_gguf_path):
    target, _ = bigram_eagle3
    return _user_traffic(LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128,
                             max_num_seqs=4))


def _spec(bigram_eagle3, tokenizer: str, **kw) -> LLM:
    target, head = bigram_eagle3
    llm = LLM(model=target, tokenizer=tokenizer, draft=head, num_speculative_tokens=K,
              max_model_len=128, max_num_seqs=4, page_size=4, num_kv_blocks=128, **kw)
    return with_emulated_graphs(llm, K)


@pytest.mark.parametrize("tree", [None, (2, 6)], ids=["chain", "tree"])
def test_after_the_dummy_requests_no_request_compiles(bigram_eagle3, smollm2_gguf_path,
                                                      vanilla_out, tree):
    kw = {} if tree is None else dict(speculative_topk=tree[0],
                                      speculative_num_draft_tokens=tree[1])
    llm = _spec(bigram_eagle3, smollm2_gguf_path, **kw)
    models = llm._compiled
    runner = llm.engine.runner
    modes, execute = [], runner.execute

    def spy(reqs, num_new):  # each dummy step: whether the early paths were on
        modes.append(runner.early.enabled)
        return execute(reqs, num_new)
    runner.execute = spy
    seconds = warm_uncaptured_paths(llm.engine)
    del runner.execute
    models.end_startup()
    assert seconds > 0
    # the last round ran with the early paths off (the late path's first launches), then on
    assert True in modes and False in modes and modes[-1] is False and runner.early.enabled
    # Counters start from zero, graph statistics count no dummy step, and no state of the
    # dummy requests carries over (request ids go on past theirs).
    assert runner._drafts is None and runner._draft_row == {} and runner._pending is None
    assert llm.engine._next_id > 0
    st = llm.stats
    assert (st.num_steps, st.num_prefill_steps, st.num_decode_tokens, st.spec.num_drafting_steps,
            st.early_propose.early, st.early_propose.late) == (0, 0, 0, 0, 0, 0)
    g = models.graphs.stats()
    assert g["replayed"] == 0 and g["without_graph"] == {}, g
    out = _user_traffic(llm)
    assert out == vanilla_out  # greedy output is vanilla decoding's
    assert models.compiled_after_startup() == {}, models.compiled_after_startup()
    assert "compiled_after_startup" not in llm.compile_stats
    assert llm.stats.num_steps > 0 and llm.stats.spec.num_drafting_steps > 0


def test_without_them_the_first_requests_compile_and_stats_say_so(bigram_eagle3,
                                                                    smollm2_gguf_path):
    """The bug class they prevent, shown by the same statistic (it can fail)."""
    llm = _spec(bigram_eagle3, smollm2_gguf_path)
    llm._compiled.end_startup()
    _user_traffic(llm)
    late = llm._compiled.compiled_after_startup()
    assert late.get("target", 0) >= 1 and late.get("draft_first_pass", 0) >= 1, late
    assert llm.compile_stats["compiled_after_startup"] == late


def test_warm_requests_fit_the_engine() -> None:
    rounds = warm_requests(max_model_len=128, page_size=16, lookahead=5, max_num_seqs=8,
                           vocab=100)
    assert [len(r) for r in rounds] == [1, 4]
    reqs = [x for r in rounds for x in r]
    lengths = [len(p) for p, _ in reqs]
    assert len(set(lengths)) == 4 and min(lengths) > 1
    assert all(len(p) + sp.max_tokens + 5 < 128 for p, sp in reqs)
    assert all(0 < t < 100 for p, _ in reqs for t in p)
    assert any(sp.temperature > 0 for _, sp in reqs)
    assert any(sp.logprobs for _, sp in reqs)  # a request kept on the late paths
    assert len({tuple(p) for p, _ in reqs}) == len(reqs)  # no prefix shared: every prefill
    # one sequence at a time: no batch round; a context too short for a drafting step: none
    assert [len(r) for r in warm_requests(64, 16, 5, 1, 100)] == [1]
    assert warm_requests(max_model_len=12, page_size=16, lookahead=5, max_num_seqs=8,
                         vocab=100) == []
    short = warm_requests(max_model_len=24, page_size=16, lookahead=5, max_num_seqs=8, vocab=50)
    assert all(len(p) + sp.max_tokens + 5 < 24 for r in short for p, sp in r)


def test_a_pool_too_small_for_them_warns_and_leaves_a_working_engine(bigram_eagle3,
                                                                     smollm2_gguf_path, caplog):
    """Start-up must not fail because its own dummy requests do not fit: it warns, frees
    what they held and resets the counters; users' requests that fit still run."""
    llm = _spec(bigram_eagle3, smollm2_gguf_path)
    target, head = bigram_eagle3
    small = LLM(model=target, tokenizer=smollm2_gguf_path, draft=head, num_speculative_tokens=K,
                max_model_len=128, max_num_seqs=4, page_size=4, num_kv_blocks=3)
    small = with_emulated_graphs(small, K)
    with caplog.at_level("WARNING"):
        warm_uncaptured_paths(small.engine)
    assert "dummy requests stopped" in caplog.text
    assert small.stats.num_steps == 0 and small.stats.num_aborted == 0
    assert not small.engine.has_unfinished()
    assert small.engine.allocator.num_free == small.engine.allocator.num_blocks
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    want = llm.generate([[3, 4]], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert small.generate([[3, 4]], sp, use_tqdm=False)[0].outputs[0].token_ids == want
