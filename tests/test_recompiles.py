"""compile=True must not recompile as requests grow: prompts crossing 1, 2, 3 and 4 KV pages, in
a vanilla and an EAGLE-3 engine, compile each callable once (size-oblivious symbols: T = 1 shares
the graph of T >= 2, CompileConfig.size_oblivious) and never again. Before the fix a one-page
block table (specialised) and duck-sized dims (a 2-entry query_start_loc tied to a 2-block
table) each cost a recompile mid-run."""
from __future__ import annotations

import json

import pytest

from compiled_spec import LLM, SamplingParams
from compiled_spec.bench.run import TINY
from compiled_spec.draft.testing import write_eagle3_head
from compiled_spec.models.loader import read_model_config


@pytest.fixture(scope="module")
def tiny_random(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("tiny_random")
    cfg = dict(TINY, num_hidden_layers=2, bos_token_id=1, eos_token_id=2)
    (d / "config.json").write_text(json.dumps(cfg))
    return f"random:{d}"


@pytest.mark.parametrize("spec", [False, True], ids=["vanilla", "eagle3"])
def test_no_recompile_across_prompt_lengths(tiny_random, smollm2_gguf_path, tmp_path,
                                            spec: bool) -> None:
    kw = dict(model=tiny_random, tokenizer=smollm2_gguf_path, max_model_len=256, compile=True)
    if spec:
        head = write_eagle3_head(str(tmp_path / "head"), read_model_config(tiny_random),
                                 aux_layer_ids=(0, 1, 1))
        kw.update(draft=head, num_speculative_tokens=3)
    llm = LLM(**kw)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    counts = []
    for n in (5, 21, 34, 55):  # 1, 2, 3 and 4 pages of 16 (with the tokens written)
        llm.generate([[7] * n], sp)
        counts.append({k: v["graphs"] for k, v in llm.compile_stats.items()
                       if isinstance(v, dict) and "graphs" in v})
    # One graph for prompts and decode (T = 1 included: no 0/1 specialization), in vanilla
    # and in a chain engine alike.
    assert counts[0]["target"] == 1, counts
    assert counts[-1] == counts[0], counts
