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
    assert counts == {"target": 1, "draft_first_pass": 1, "draft_step": 1,
                      "draft_step_pick": 1, "draft_pick_plan": 1}, counts


def test_paused_chain_engine_compiles_each_callable_once(trained_eagle3_pair, smollm2_gguf_path):
    """Paused steps too: their deferred first passes flush from the first-pass graph (a full
    ring) and through the compiled first pass (a change to drafting)."""
    counts, st = _compiled_graphs(trained_eagle3_pair, smollm2_gguf_path,
                                  [SPEC] * 2 + [PLAIN] * 12, speculation_policy="adaptive")
    reasons = st["deferred"].flush_reasons
    assert reasons.get("full", 0) > 0 and reasons.get("draft", 0) > 0, reasons
    assert counts == {"target": 1, "draft_first_pass": 1, "draft_step": 1,
                      "draft_step_pick": 1, "draft_pick_plan": 1}, counts


def test_tree_engine_compiles_each_callable_once(trained_eagle3_pair, smollm2_gguf_path):
    counts, st = _compiled_graphs(trained_eagle3_pair, smollm2_gguf_path, speculative_topk=2,
                                  speculative_num_draft_tokens=6)
    assert st["components"]["tree_draft_early"]["graph_replays"] > 0
    # the target twice: causal, and with tree attention (a guard on the tree mask)
    assert counts == {"target": 2, "draft_first_pass": 1, "draft_step": 1, "tree_head": 1,
                      "tree_step": 1, "tree_finish": 1, "tree_early_stage": 1}, counts
