"""A prompt step's heads written while the host waits for its tokens (engine/prompt_head.py):
the same outputs, logprobs and draft work as writing them in the proposal, in steps that mix
new prompts with requests verifying drafts, greedy and sampled (rejection sampling, whose
device-to-host copy is two-dimensional); a step verifying drafts and returning logprobs cuts
its heads late, counted (one without drafts computes them first and goes early). CPU, emulated
graphs over our passes, against the same engine with ``early_prompt_head=False`` and against
vanilla decoding."""
from __future__ import annotations

import numpy as np

from compiled_spec import LLM, SamplingParams
from tests.engine_runs import with_emulated_graphs

K = 3
# 9 requests on 4 sequences: later ones start while earlier ones verify drafts (mixed steps);
# every prompt is longer than k + 1, so a span of k + 1 rows in a step is a verifying request
PROMPTS = [[(7 * i + j * j) % 60 + 2 for j in range(6 + 5 * i)] for i in range(9)]
SPS = [SamplingParams(max_tokens=3 + 2 * (i % 4), ignore_eos=True, seed=11 + i,
                      temperature=0.0 if i % 3 == 0 else 0.8,
                      logprobs=2 if i == 7 else None) for i in range(9)]


def _run(llm: LLM) -> list[tuple[list[int], list | None]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
            for o in llm.generate(PROMPTS, SPS, use_tqdm=False)]


def test_early_heads_match_late_heads_and_vanilla(bigram_eagle3, smollm2_gguf_path):
    target, head = bigram_eagle3
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, max_num_seqs=4,
              page_size=4, num_kv_blocks=160, min_admit=1)
    engines = {}
    mixed = []  # per early launch: whether some request in it verified drafts
    for early in (True, False):
        llm = with_emulated_graphs(LLM(**kw, draft=head, num_speculative_tokens=K,
                                       early_prompt_head=early), K,
                                   prefill_sizes=(16, 32, 64), mixed_sizes=(64, 128),
                                   mixed_query_len=64)
        ph = llm.engine.runner.prompt_head
        launch = ph.launch

        def spy(p, launch=launch):
            lengths = np.array([s.length for s in p.spans])
            mixed.append(bool(((p.cuts == 0) & (lengths == K + 1)).any()))
            return launch(p)

        ph.launch = spy
        engines[early] = (_run(llm), llm.stats.prompt_head.as_dict(), llm)
        assert llm.stats.num_step_faults == 0  # (a step that raised is retried, exactly)
    (early_out, early_stats, early_llm), (late_out, late_stats, late_llm) = (engines[True],
                                                                         engines[False])
    assert early_out == late_out
    assert any(mixed), "no step mixed a new prompt with requests verifying drafts"
    # Heads written early in every prompt step but those the logprobs request is part of;
    # with the switch off, none
    assert early_stats["early"] == len(mixed) >= 4
    assert list(early_stats["late"]) == ["logprobs"]
    assert late_stats == {"early": 0, "rows": 0, "late": {}}
    # A prompt step without drafts computes its logprobs before the wait: its heads go early
    one = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, ignore_eos=True)
    before = early_llm.stats.prompt_head.as_dict()
    got = early_llm.generate([PROMPTS[8]], [one], use_tqdm=False)[0].outputs[0]
    after = early_llm.stats.prompt_head.as_dict()
    want = late_llm.generate([PROMPTS[8]], [one], use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)
    assert after["early"] == before["early"] + 1 and after["late"] == before["late"]
    # Greedy requests: vanilla's tokens
    vanilla = _run(LLM(**kw))
    for i, sp in enumerate(SPS):
        if sp.temperature == 0.0:
            assert early_out[i][0] == vanilla[i][0], i
