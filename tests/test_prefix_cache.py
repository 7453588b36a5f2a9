"""Prefix caching: the allocator's shared blocks (reference counts, LRU eviction, full-key check),
and the engine: outputs and acceptance identical with and without caching, vanilla and EAGLE,
greedy and seeded sampling, page sizes 1 and 16, under memory pressure too."""
from __future__ import annotations

import random

import pytest

from compiled_spec import LLM, SamplingParams
from compiled_spec.kv_cache import BlockAllocator
from compiled_spec.prefix_cache import block_keys, matchable_blocks


def test_allocator_shares_and_evicts_lru():
    a = BlockAllocator(6, 2, prefix_caching=True)
    toks = [1, 2, 3, 4, 5, 6, 7]
    keys = block_keys(toks, 2, matchable_blocks(len(toks), 2), with_successor=True)
    assert len(keys) == 3 and keys[0][1] == (None, (1, 2), 3)
    a.grow(0, 7)  # 4 blocks
    for i, (h, k) in enumerate(keys):
        a.register(0, i, h, k)
    assert a.match(1, keys[:2]) == 2 and a.tables[1] == a.tables[0][:2]  # shared, refs 2
    a.free(0)
    assert a.num_free == 6 - 2  # request 1 still holds two shared blocks
    a.free(1)
    assert a.num_free == 6 and a.num_cached == 3
    # A different successor is another key: no match (the draft's last entry would differ).
    other = block_keys([1, 2, 9], 2, 1, with_successor=True)
    assert a.match(2, other) == 0
    a.free(2)
    a.grow(3, 12)  # all 6 blocks: the 3 cached ones are evicted, least recently used first
    assert a.num_evictions == 3 and a.num_cached == 0
    a.free(3)
    assert a.match(4, keys) == 0


def _prompts(seed: int, page: int) -> list[list[int]]:
    """Shared prefixes of 0, a partial block, one block and many blocks, plus a repeat."""
    rng = random.Random(seed)
    base = [rng.randrange(32) for _ in range(5 * page + 3)]
    tail = lambda n: [rng.randrange(32) for _ in range(n)]  # noqa: E731
    return [base[:page // 2 + 1] + tail(7), base[:page] + tail(5), base + tail(4),
            base[:3 * page] + tail(page + 2), tail(2 * page + 1), list(base)]


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("spec", [False, True])
def test_outputs_and_tau_identical_with_caching(trained_eagle3_pair, smollm2_gguf_path, page,
                                                spec):
    target, head = trained_eagle3_pair
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=256, max_num_seqs=3,
              page_size=page, **(dict(draft=head, num_speculative_tokens=3) if spec else {}))
    first, second = _prompts(1, page), _prompts(1, page)[::-1]
    params = [SamplingParams(max_tokens=20, temperature=t, seed=s, ignore_eos=True)
              for t, s in ((0.0, 0), (0.9, 4), (0.0, 0), (1.1, 2), (0.0, 0), (0.7, 8))]
    results = {}
    for caching in (False, True):
        llm = LLM(**kw, enable_prefix_caching=caching)
        outs = [o.token_ids for o in llm.generate(first, params)]
        outs += [o.token_ids for o in llm.generate(second, params)]  # reuses the first pass
        results[caching] = (outs, llm.stats.spec.mean_acceptance_length,
                            llm.stats.num_cached_tokens)
        assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks
    assert results[True][0] == results[False][0]
    assert results[True][1] == results[False][1]  # tau (None for vanilla)
    assert results[False][2] == 0 and results[True][2] >= 4 * page  # prefill tokens saved


@pytest.mark.parametrize("mode", ["successor", "recompute"])
def test_eagle_modes_and_memory_pressure(trained_eagle3_pair, smollm2_gguf_path, mode):
    """A pool too small for everything: cached blocks get evicted while requests run; no request
    is lost and outputs stay exact, in both ways of handling the draft's shifted KV."""
    target, head = trained_eagle3_pair
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=256, max_num_seqs=4,
              page_size=4, num_kv_blocks=48, draft=head, num_speculative_tokens=3)
    prompts = _prompts(3, 4) + _prompts(4, 4) + _prompts(3, 4)
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    ref = [o.token_ids for o in LLM(**kw).generate(prompts, sp)]
    llm = LLM(**kw, enable_prefix_caching=True, prefix_caching_mode=mode)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    assert llm.engine.allocator.num_evictions > 0 and llm.stats.num_cached_tokens > 0
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks
