"""The draft's first pass over prompts through its own graphs (engine/draft_prefill_graph.py):
the draft KV they write at every prompt position is the uncaptured first pass's, in engines
that draft (the positions before the propose graph's k + 1, or a tree's first-pass graph's
rows) and in paused prompt steps (the whole first pass); steps no graph holds are counted by
reason. The positions before the graphed proposal's (a prompt's head) are written while the
host waits for the prompt step's tokens (engine/prompt_head.py), or with
``early_prompt_head=False`` in the proposal ("paused_late": a paused prompt step's whole first
pass through the prompt graphs). CPU, emulated graphs over our passes (no Inductor), against
eager engines."""
from __future__ import annotations

import pytest
import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.spec.policy import PLAIN
from tests.engine_runs import with_emulated_graphs
from tests.policy_stub import ModesInTurn
from tests.spec_models import write_bigram_target, write_mirror_eagle1

K = 3
# 12 and 20 tokens alone, then three at once (30 tokens: the varlen graphs), then 45 tokens,
# then 100: past every graph's 64-token query limit
PROMPTS = [[5, 1, 2, 8, 8, 3, 1, 9, 9, 4, 2, 7], [6] * 20,
           [[4, 9, 2, 6, 1], [7] * 9, [2, 3] * 8], [3 + i % 40 for i in range(45)],
           [1 + i % 37 for i in range(100)]]
PROMPTS_FLAT = [p for call in PROMPTS for p in (call if isinstance(call[0], list) else [call])]
SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _draft_kv(llm: LLM, paused: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
    """(outputs, the draft layer's K and V over each prompt's positions) of every call."""
    eng = llm.engine
    if paused:  # every step paused: a prompt step's proposal is its first pass alone
        eng.stats.policy = ModesInTurn([PLAIN])
    tables, free = {}, eng.allocator.free

    def keep_table(req_id: int) -> None:
        tables[req_id] = list(eng.allocator.tables.get(req_id, ()))
        return free(req_id)

    eng.allocator.free = keep_table
    k_cache, v_cache = eng.kv_caches[eng.model.config.num_hidden_layers]  # the draft layer's
    page = eng.allocator.page_size
    outs, kv = [], []
    for call in PROMPTS:
        prompts = call if isinstance(call[0], list) else [call]
        for o, p in zip(llm.generate(prompts, SP, use_tqdm=False), prompts):
            outs.append(o.outputs[0].token_ids)
            t = tables[o.request_id]
            kv.append(torch.stack([torch.stack([k_cache[t[q // page], q % page],
                                                v_cache[t[q // page], q % page]])
                                   for q in range(len(p))]))
    eng.allocator.free = free
    return outs, kv


@pytest.fixture(scope="module")
def eagle1_pair(tmp_path_factory):
    """EAGLE-1: the target's final hidden state feeds the draft as it is (no fc before it)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("prompt_graphs")
    target = write_bigram_target(root / "target", vocab=64, layers=2)
    head = write_mirror_eagle1(root / "head", target, noise=0.3)
    # An fc that reads the target's hidden too (the mirror head's reads the embedding alone),
    # so the draft KV depends on the hidden rows the graphs stage.
    sd = load_file(f"{head}/model.safetensors")
    g = torch.Generator().manual_seed(3)
    sd["fc.weight"] = sd["fc.weight"] + 0.2 * torch.randn(sd["fc.weight"].shape, generator=g)
    save_file(sd, f"{head}/model.safetensors")
    return target, head


@pytest.mark.parametrize("engine", ["chain", "paused", "paused_late", "tree", "eagle1"])
def test_prompt_first_pass_graphs_write_the_eager_draft_kv(bigram_eagle3, eagle1_pair,
                                                          smollm2_gguf_path, engine):
    target, head = eagle1_pair if engine == "eagle1" else bigram_eagle3
    paused = engine.startswith("paused")
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, max_num_seqs=4,
              page_size=4, num_kv_blocks=128, draft=head, num_speculative_tokens=K,
              speculation_policy="adaptive" if paused else "always")
    if engine == "tree":  # (its first-pass graph takes num_steps + 1 = 3 rows per request)
        kw |= dict(speculative_topk=2, speculative_num_draft_tokens=6, speculative_num_steps=2)
    want, want_kv = _draft_kv(LLM(**kw), paused)
    late = engine == "paused_late"
    llm = with_emulated_graphs(LLM(**kw, early_prompt_head=not late), K,
                               prefill_sizes=(16, 32, 64), mixed_sizes=(64, 128),
                               mixed_query_len=64)
    got, got_kv = _draft_kv(llm, paused)
    assert got == want
    assert llm.stats.num_step_faults == 0  # (a step that raised is retried, exactly)
    for g, w in zip(got_kv, want_kv):
        assert g.abs().sum() > 0  # (positions a first pass never wrote would be zeros)
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    comp = llm.compile_stats["cuda_graphs"]["components"]
    dp = {q: comp[f"draft_prefill_{q}"] for q in (16, 32, 64, 128)}
    # Every prompt step has heads (each call's prompts pass k + 1 tokens), written early
    # unless turned off.
    rows = 3 if engine == "tree" else K + 1  # the graphed proposal's rows per request
    heads = {"early": len(PROMPTS), "rows": sum(len(p) - rows for p in PROMPTS_FLAT), "late": {}}
    assert llm.stats.prompt_head.as_dict() == (
        {"early": 0, "rows": 0, "late": {}} if late else heads)
    if late:
        # A paused prompt step's whole first pass, in the proposal. Prompts within the
        # first-pass graphs' rows per request replay those (12, 20, the three prompts); 45
        # tokens replays the prompt graph of 64.
        sync = comp["draft_sync"]
        assert 30 <= llm.engine.runner.proposer.sync_graph.q < 45
        assert sync["graph_replays"] >= 3 and "prefill" not in sync["fallback_reasons"], sync
        want_replays = {16: 0, 32: 0, 64: 1, 128: 0}
    elif engine in ("chain", "eagle1", "paused"):
        # The positions before the propose graph's k + 1 (paused: the rest through the
        # first-pass graph): 12 -> 8 and 20 -> 16 (in 16), the three prompts' 1 + 5 + 12 (in
        # 32), 45 -> 41 (in 64).
        want_replays = {16: 2, 32: 1, 64: 1, 128: 0}
        if paused:
            sync = comp["draft_sync"]
            assert sync["graph_replays"] >= 5 and sync["fallback_reasons"] == {}, sync
    else:
        # A tree: those before its first-pass graph's 3: 12 -> 9 (in 16), 20 -> 17 and the
        # three prompts' 2 + 6 + 13 (in 32), 45 -> 42 (in 64).
        first = comp["tree_draft_first_pass"]
        assert first["graph_replays"] > 0 and "query_len" not in first["fallback_reasons"], first
        want_replays = {16: 1, 32: 2, 64: 1, 128: 0}
    assert {q: c["graph_replays"] for q, c in dp.items()} == want_replays, dp
    # 100 tokens: past the 64-token query limit of every size, counted by the largest
    assert dp[128]["fallback_reasons"] == {"query_len": 1}
    assert all(dp[q]["fallback_reasons"] == {} for q in (16, 32, 64))


def test_no_prompt_graphs_without_prompt_sizes(bigram_eagle3, smollm2_gguf_path):
    target, head = bigram_eagle3
    llm = with_emulated_graphs(LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128,
                                   max_num_seqs=4, draft=head, num_speculative_tokens=K), K)
    assert llm.engine.runner.proposer.prefill_graph is None
    assert not any(n.startswith("draft_prefill")
                   for n in llm.compile_stats["cuda_graphs"]["components"])
