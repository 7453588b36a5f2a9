"""Seeded, bounded fuzzing of SamplingParams and prompts against a live engine (vanilla and
EAGLE-3, tiny synthetic checkpoints): bad requests are refused with a ValueError, injected
faults abort only their own request, and after every call the engine is idle with every KV
block back in the pool and still gives the same output for the same request."""
import random

import pytest

from compiled_spec import LLM, SamplingParams
from tests.engine_runs import with_emulated_graphs
from tests.fuzz_requests import inject_faults, random_request

VOCAB, MAX_LEN = 64, 48
ROUNDS = 60


def _idle_and_full(llm: LLM) -> None:
    a = llm.engine.allocator
    assert a.num_free == a.num_blocks and not a.tables and not llm.engine.has_unfinished()


@pytest.mark.parametrize("engine", ["vanilla", "eagle3", "eagle3-tree"])
def test_fuzz_requests_keep_the_engine_usable(engine, bigram_eagle3, smollm2_gguf_path):
    target, head = bigram_eagle3
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=MAX_LEN, page_size=4,
              max_num_seqs=4, num_kv_blocks=40, enable_prefix_caching=engine == "vanilla")
    if engine != "vanilla":
        kw.update(draft=head, num_speculative_tokens=3)
    if engine == "eagle3-tree":
        kw.update(speculative_topk=2, speculative_num_draft_tokens=6)
    llm = LLM(**kw)
    inject_faults(llm)
    probe = ([3, 1, 4, 1, 5], SamplingParams(max_tokens=12, temperature=0.9, seed=5,
                                             ignore_eos=True))
    want = llm.generate([probe[0]], probe[1])[0].token_ids
    rng = random.Random(f"fuzz-{engine}")
    refused = aborted = served = 0
    for _ in range(ROUNDS):
        reqs = [random_request(rng, VOCAB, MAX_LEN) for _ in range(rng.randint(1, 6))]
        if any(r.bad for r in reqs):
            with pytest.raises(ValueError):
                if any(r.params is None for r in reqs):
                    raise ValueError("refused at construction")
                llm.generate([r.prompt for r in reqs], [r.params for r in reqs])
            refused += 1
            _idle_and_full(llm)
            reqs = [r for r in reqs if not r.bad]
            if not reqs:
                continue
        outs = llm.generate([r.prompt for r in reqs], [r.params for r in reqs])
        for r, o in zip(reqs, outs):
            if o.finish_reason == "abort":
                assert r.fault and "injected fault" in o.outputs[0].error
                aborted += 1
            else:
                assert len(o.outputs) == r.params.n
                for c in o.outputs:
                    assert c.finish_reason in ("stop", "length"), o
                    assert 1 <= len(c.token_ids) <= r.params.max_tokens
                    assert all(0 <= t < VOCAB for t in c.token_ids)
                    if r.params.logprobs is not None:
                        assert [t in d for t, d in zip(c.token_ids, c.logprobs)] == \
                            [True] * len(c.token_ids)
                served += 1
        _idle_and_full(llm)
    assert refused > 3 and aborted >= 1 and served > 20, (refused, aborted, served)
    assert llm.generate([probe[0]], probe[1])[0].token_ids == want  # same engine, same answer
    _idle_and_full(llm)


@pytest.mark.heavy
@pytest.mark.parametrize("engine", ["vanilla", "eagle3", "eagle3_tree"])
def test_fuzz_verify_ahead_matches_plain(engine, bigram_eagle3, smollm2_gguf_path):
    """Engines that launch each next step's target forward before the bookkeeping
    (engine/verify_ahead.py: vanilla from the device argmax, EAGLE-3 chains and trees from their
    early steps, through emulated graphs) against the same engine without it, on the same random
    requests and injected faults: identical outputs and finish reasons, the engine idle after
    every call, and launches actually taken (greedy batches) or skipped by reason."""
    target, head = bigram_eagle3
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=MAX_LEN,
              page_size=4, max_num_seqs=4, num_kv_blocks=60, enable_prefix_caching=True)
    if engine != "vanilla":
        kw.update(draft=head, num_speculative_tokens=3)
    if engine == "eagle3_tree":
        kw.update(speculative_topk=2, speculative_num_draft_tokens=6)
    llms = [LLM(verify_ahead=on, **kw) for on in (False, True)]
    if engine != "vanilla":
        llms = [with_emulated_graphs(llm, 3, MAX_LEN) for llm in llms]
    for llm in llms:
        inject_faults(llm)
    rng = random.Random(f"fuzz-ahead-{engine}")
    compared = 0
    # the tree engine's steps cost ~2x the chain's on the CPU: fewer rounds keep CI in budget
    # (85 s and 70 s for the tree and the chain at 28 / 40 rounds, forty-first session)
    for _ in range(20 if engine == "eagle3_tree" else 28):
        reqs = [random_request(rng, VOCAB, MAX_LEN) for _ in range(rng.randint(1, 6))]
        reqs = [r for r in reqs if not r.bad]
        if not reqs:
            continue
        if rng.random() < 0.6:  # mostly greedy batches: where decode ahead launches
            for r in reqs:
                r.params.temperature = 0.0
        outs = [llm.generate([r.prompt for r in reqs], [r.params for r in reqs])
                for llm in llms]
        for a, b in zip(*outs):
            assert [(c.token_ids, c.finish_reason) for c in a.outputs] == \
                [(c.token_ids, c.finish_reason) for c in b.outputs]
            compared += 1
        for llm in llms:
            _idle_and_full(llm)
    st = llms[1].stats.verify_ahead
    assert compared > 40 and st.launched > 0 and st.taken > 0, (compared, st.as_dict())
    assert llms[0].stats.verify_ahead.launched == 0
