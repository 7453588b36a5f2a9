"""One sequence's prompt step through a graph padded to a captured query length
(``target_prefill_<Q>``, capture.policy.prefill_sizes): vanilla, chain and tree engines give
vanilla eager decoding's tokens, every one-sequence prompt that fits replays the smallest graph
that holds it, and the rest (several sequences, a longer prompt) run compiled and are counted.
CPU, with emulated graphs over our passes (no Inductor); the emulation poisons graph outputs at
the next replay, so a reader that keeps the prompt step's hidden states too long fails here."""
from __future__ import annotations

import pytest

from compiled_spec import LLM, SamplingParams
from tests.engine_runs import with_emulated_graphs

K = 3
SIZES = (16, 32)
PROMPTS = [[4, 9, 2], [5, 1, 2, 8, 8, 3, 1, 9, 9, 4, 2, 7], [6] * 20, [3 + i % 40 for i in range(45)]]


def _run(llm: LLM) -> list[list[int]]:
    """Each prompt alone (3, 12, 20, 45 tokens), then two at once."""
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    out = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    out += [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], sp, use_tqdm=False)]
    return out


@pytest.fixture(scope="module")
def want(bigram_eagle3, smollm2_gguf_path):
    target, _ = bigram_eagle3
    return _run(LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, max_num_seqs=4))


@pytest.mark.parametrize("engine", ["vanilla", "chain", "tree"])
def test_prompt_steps_replay_prefill_graphs(bigram_eagle3, smollm2_gguf_path, want, engine):
    target, head = bigram_eagle3
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, max_num_seqs=4,
              page_size=4, num_kv_blocks=128)
    if engine != "vanilla":
        kw |= dict(draft=head, num_speculative_tokens=K)
    if engine == "tree":
        kw |= dict(speculative_topk=2, speculative_num_draft_tokens=6)
    llm = with_emulated_graphs(LLM(**kw), K if engine != "vanilla" else 0, prefill_sizes=SIZES)
    assert _run(llm) == want
    comp = llm.compile_stats["cuda_graphs"]["components"]
    replays = {q: comp[f"target_prefill_{q}"]["graph_replays"] for q in SIZES}
    # 12 tokens pad to 16, 20 to 32; 3 tokens too, except in a chain engine, whose batch-1
    # verify graph (k + 1 = 4 rows) holds them. 45 tokens and the two-prompt step: no graph.
    short = engine != "chain"
    assert replays == {16: 1 + short, 32: 1}, replays
    assert comp["target_prefill_16"]["padded_rows"] == (16 - 12) + short * (16 - 3)
    assert comp["target_decode"]["prefill_calls"] == 2
    assert all(comp[f"target_prefill_{q}"]["eager_fallbacks"] == 0 for q in SIZES)


def test_no_prefill_sizes_no_prefill_graphs(bigram_eagle3, smollm2_gguf_path, want):
    target, _ = bigram_eagle3
    llm = with_emulated_graphs(LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128,
                                   max_num_seqs=4), 0)
    assert _run(llm) == want
    comp = llm.compile_stats["cuda_graphs"]["components"]
    assert not any(n.startswith("target_prefill") for n in comp)
    assert comp["target_decode"]["prefill_calls"] == 5  # 4 prompts alone, one step of two
