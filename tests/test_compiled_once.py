"""Each compiled callable compiles once per engine, whatever path reaches it: CUDA-graph bodies
(emulated here), steps no graph holds (prompts beside running requests: ``as_static``), the
early tree step's staging (which writes the late graphs' buffers itself). A second compile is
seconds of start-up on a GPU, or a stall inside a request; the H100's EAGLE chain engines
compiled their target twice before the thirty-eighth session (graph buffers vs host-built
inference tensors)."""
from capture import CapturePolicy
from compiled_spec import LLM, SamplingParams
from compiled_spec.compile import CompileConfig, capture_graphs, compile_models
from compiled_spec.spec.policy import PLAIN, SPEC
from tests.policy_stub import ModesInTurn

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 2], [11, 12], [6, 6, 6, 1, 2, 30, 8, 8, 8, 1]]
SP = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def _compiled_graphs(pair, tok: str, modes: list[str] | None = None, **spec
                     ) -> tuple[dict[str, int], dict]:
    """Eager output, then our passes without Inductor (Dynamo's guards are what count) on
    emulated graphs with prefill graphs too short for the batched prompts; -> graphs per
    compiled callable, graph stats. The graphed output must be the eager one. ``modes``: an
    adaptive engine's modes in turn (drafting, paused)."""
    target, head = pair
    llm = LLM(model=target, tokenizer=tok, draft=head, num_speculative_tokens=3,
              max_model_len=128, max_num_seqs=4, **spec)
    eager = [o.token_ids for o in llm.generate(PROMPTS, SP)]
    models = compile_models(llm.engine.runner, CompileConfig(inductor=False))
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=3, max_model_len=128,
                           batch_sizes=(1, 2, 4), seq_len_buckets=(32, 128),
                           prefill_sizes=(16, 32))
    graphs = capture_graphs(llm.engine.runner, models, policy, llm.config.cache.page_size,
                            emulate=True)
    if modes is not None:
        llm.engine.stats.policy = ModesInTurn(modes)
    assert [o.token_ids for o in llm.generate(PROMPTS, SP)] == eager
    st = graphs.stats() | {"deferred": llm.stats.deferred_first_pass}
    return {n: len(b.compiled) for n, b in models.backends.items()}, st


def test_chain_engine_compiles_each_callable_once(trained_eagle3_pair, smollm2_gguf_path):
    counts, st = _compiled_graphs(trained_eagle3_pair, smollm2_gguf_path)
    assert st["components"]["target_decode"]["prefill_calls"] > 0  # steps outside the graphs
    # No first pass runs uncaptured: a prompt's positions before the propose graph's replay the
    # draft's prompt graphs (engine/draft_prefill_graph.py), and compile nothing more.
    assert st["components"]["draft_prefill_16"]["graph_replays"] > 0
    assert counts == {"target": 1, "draft_first_pass": 0, "draft_step": 1,
                      "draft_step_pick": 1, "draft_pick_plan": 1}, counts


def test_paused_chain_engine_compiles_each_callable_once(trained_eagle3_pair, smollm2_gguf_path):
    """Paused steps too: their deferred first passes flush (a full ring, a change to drafting)
    from the first-pass graphs, and their prompts' from the draft's prompt graphs."""
    counts, st = _compiled_graphs(trained_eagle3_pair, smollm2_gguf_path,
                                  [SPEC] * 2 + [PLAIN] * 12, speculation_policy="adaptive",
                                  paused_flush_depth=4)
    reasons = st["deferred"].flush_reasons
    assert reasons.get("full", 0) > 0 and reasons.get("draft", 0) > 0, reasons
    # (every flush and prompt here replays a graph: the first pass never runs uncaptured)
    assert counts == {"target": 1, "draft_first_pass": 0, "draft_step": 1,
                      "draft_step_pick": 1, "draft_pick_plan": 1}, counts


def test_tree_engine_compiles_each_callable_once(trained_eagle3_pair, smollm2_gguf_path):
    counts, st = _compiled_graphs(trained_eagle3_pair, smollm2_gguf_path, speculative_topk=2,
                                  speculative_num_draft_tokens=6)
    assert st["components"]["tree_draft_early"]["graph_replays"] > 0
    # the target twice: causal, and with tree attention (a guard on the tree mask); the first
    # pass never uncaptured (prompts: the draft's prompt graphs, then the tree's first-pass
    # graph)
    assert st["components"]["draft_prefill_16"]["graph_replays"] > 0
    assert counts == {"target": 2, "draft_first_pass": 0, "draft_step": 1, "tree_head": 1,
                      "tree_step": 1, "tree_finish": 1, "tree_early_stage": 1}, counts


def test_narrow_pdl_target_takes_the_narrow_graphs(trained_eagle3_pair, smollm2_gguf_path,
                                                   monkeypatch):
    """PDL on the narrow calls of a wide engine (``CompileConfig.pdl_narrow``): the target is
    compiled twice, once with PDL for the graphs of at most PDL_MAX_ROWS rows (4 here) and once
    without for the wider; each compiles once, each graph captured the one its rows pick, and
    the output is the eager one."""
    import compiled_spec.pdl_policy as pdl_policy

    monkeypatch.setattr(pdl_policy, "PDL_MAX_ROWS", 4)
    target, head = trained_eagle3_pair
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, draft=head, num_speculative_tokens=3,
              max_model_len=128, max_num_seqs=4)
    eager = [o.token_ids for o in llm.generate(PROMPTS, SP)]
    models = compile_models(llm.engine.runner,
                            CompileConfig(inductor=False, pdl=True, pdl_narrow=True),
                            max_decode_rows=16)
    assert models.pdl.max_rows == 4 and "<= 4 rows" in models.pdl.why, models.pdl
    rows: dict[str, list[int]] = {"target": [], "target_pdl": []}
    for name in rows:  # the rows each compiled target is called with
        real = models.compiled[name]
        models.compiled[name] = (lambda real, seen: lambda ids, *a: (
            seen.append(ids.shape[0]), real(ids, *a))[1])(real, rows[name])
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=3, max_model_len=128,
                           batch_sizes=(1, 2, 4), seq_len_buckets=(32, 128),
                           prefill_sizes=(16, 32))
    capture_graphs(llm.engine.runner, models, policy, llm.config.cache.page_size, emulate=True)
    # decode at batch 2 / 4 and batch 1's verify (4 rows; it also serves batch 1's decode)
    # narrow; the other verifies and the prompts wide
    assert set(rows["target_pdl"]) == {2, 4}, rows
    assert min(rows["target"]) > 4 and {8, 16, 32} <= set(rows["target"]), rows
    assert [o.token_ids for o in llm.generate(PROMPTS, SP)] == eager
    counts = {n: len(b.compiled) for n, b in models.backends.items()}
    assert counts["target"] == 1 and counts["target_pdl"] == 1, counts
    assert max(rows["target_pdl"]) <= 4 and min(rows["target"]) > 4, rows
