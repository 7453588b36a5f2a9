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
    if engine == "tree":  # the first pass after a prompt: its head eager, the rest replayed
        assert comp["tree_draft_first_pass"]["fallback_reasons"] == {}, comp["tree_draft_first_pass"]
        assert comp["tree_draft_first_pass"]["graph_replays"] > 0
    if engine == "chain":
        # The proposals after prompt steps replay the propose graph too (the first pass's head
        # eager: compiled_spec/spec/first_pass_split.py), and draft exactly what the eager
        # engine drafts: the same acceptance.
        assert "prefill" not in comp["draft_propose"]["fallback_reasons"], comp["draft_propose"]
        # The first pass's head replays the draft's prompt graphs (engine/draft_prefill_graph.py):
        # 12 tokens -> 8 leading positions, 20 -> 16, the pair's 12-token prompt -> 8, each in
        # 16; 45 -> 41 positions, past the 32-token query limit: uncaptured, counted.
        assert {q: comp[f"draft_prefill_{q}"]["graph_replays"] for q in SIZES} == {16: 3, 32: 0}
        assert comp["draft_prefill_16"]["padded_rows"] == 8 + 0 + 8
        assert comp["draft_prefill_32"]["fallback_reasons"] == {"query_len": 1}
        eager = LLM(**kw)
        assert _run(eager) == want
        assert llm.stats.spec.num_accepted_tokens == eager.stats.spec.num_accepted_tokens
        assert llm.stats.spec.num_drafting_steps == eager.stats.spec.num_drafting_steps


MIXED_PROMPTS = PROMPTS[:3] + [[7, 7, 7], [8, 1], [9, 9, 9, 9, 9]]
MIXED_SPS = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
             for m in (4, 12, 6, 10, 8, 9)]


@pytest.mark.parametrize("engine", ["vanilla", "chain", "tree"])
def test_prompt_steps_of_several_sequences_replay_the_varlen_graph(
        bigram_eagle3, smollm2_gguf_path, engine):
    """``target_prefill_mixed``: four prompts at once (38 tokens) and prompts admitted beside
    requests decoding (their drafts verified in the same step) replay the varlen graph, padded
    to 64 tokens and 4 sequences; a 45-token prompt passes its 32-token query limit and runs
    compiled, counted under "query_len". Output is vanilla eager decoding's."""
    target, head = bigram_eagle3
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, max_num_seqs=4,
              page_size=4, num_kv_blocks=128)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(
        MIXED_PROMPTS, MIXED_SPS, use_tqdm=False)]
    if engine != "vanilla":
        kw |= dict(draft=head, num_speculative_tokens=K)
    if engine == "tree":
        kw |= dict(speculative_topk=2, speculative_num_draft_tokens=6)
    llm = with_emulated_graphs(LLM(**kw), K if engine != "vanilla" else 0, prefill_sizes=SIZES,
                               mixed_sizes=(32, 64), mixed_query_len=32)
    got = [o.outputs[0].token_ids for o in llm.generate(MIXED_PROMPTS, MIXED_SPS,
                                                        use_tqdm=False)]
    assert got == want
    comp = llm.compile_stats["cuda_graphs"]["components"]
    mixed = comp["target_prefill_mixed"]
    assert mixed["graph_replays"] >= 2 and mixed["eager_fallbacks"] == 0, mixed
    assert comp["target_decode"]["prefill_calls"] == 0
    long = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[3], PROMPTS[0]], MIXED_SPS[:2],
                                                         use_tqdm=False)]
    assert long == [o.outputs[0].token_ids for o in LLM(**{
        k: v for k, v in kw.items() if k not in ("draft", "num_speculative_tokens",
                                                 "speculative_topk",
                                                 "speculative_num_draft_tokens")}).generate(
        [PROMPTS[3], PROMPTS[0]], MIXED_SPS[:2], use_tqdm=False)]
    assert mixed["fallback_reasons"] == {} and llm.compile_stats["cuda_graphs"]["components"][
        "target_prefill_mixed"]["fallback_reasons"] == {"query_len": 1}


def test_split_first_pass_keeps_every_position_once():
    from compiled_spec.engine.batch import Span
    from compiled_spec.spec.first_pass_split import split_first_pass
    from compiled_spec.spec.proposer import ProposeBatch

    batch = ProposeBatch(first_pass=[Span(7, 0, 10), Span(8, 20, 3), Span(9, 5, 6)],
                         token_ids=list(range(100, 119)), hidden_rows=list(range(19)),
                         step_limits=[30, 40, 50], temperature=[0.0, 0.5, 0.0], seeds=[1, 2, 3])
    pre, rest = split_first_pass(batch, 4)
    assert [(s.req_id, s.start, s.length) for s in pre.first_pass] == [(7, 0, 6), (9, 5, 2)]
    assert pre.token_ids == list(range(100, 106)) + [113, 114]
    assert pre.hidden_rows == list(range(6)) + [13, 14]
    assert [(s.req_id, s.start, s.length) for s in rest.first_pass] == [
        (7, 6, 4), (8, 20, 3), (9, 7, 4)]
    assert rest.token_ids == list(range(106, 113)) + list(range(115, 119))
    assert rest.hidden_rows == list(range(6, 13)) + list(range(15, 19))
    assert (rest.step_limits, rest.temperature, rest.seeds) == (
        batch.step_limits, batch.temperature, batch.seeds)
    short = ProposeBatch(first_pass=[Span(1, 3, 4)], token_ids=[1, 2, 3, 4],
                         hidden_rows=[0, 1, 2, 3], step_limits=[9], temperature=[0.0], seeds=[0])
    assert split_first_pass(short, 4) == (None, short)


def test_no_prefill_sizes_no_prefill_graphs(bigram_eagle3, smollm2_gguf_path, want):
    target, _ = bigram_eagle3
    llm = with_emulated_graphs(LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128,
                                   max_num_seqs=4), 0)
    assert _run(llm) == want
    comp = llm.compile_stats["cuda_graphs"]["components"]
    assert not any(n.startswith("target_prefill") for n in comp)
    assert comp["target_decode"]["prefill_calls"] == 5  # 4 prompts alone, one step of two


def test_prefill_graphs_only_take_buckets_that_hold_their_prompt(bigram_eagle3,
                                                                 smollm2_gguf_path, want):
    """A prompt of q tokens has a context of at least q: a prefill graph is captured only at
    max_seq_len buckets >= its query length (a 32-token dummy prompt in a 16-token context
    would be no batch the engine can meet)."""
    from capture import CapturePolicy
    from compiled_spec.compile import CompileConfig, capture_graphs, compile_models

    target, _ = bigram_eagle3
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, max_num_seqs=4)
    models = compile_models(llm.engine.runner, CompileConfig(inductor=False))
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=0, max_model_len=128,
                           batch_sizes=(1, 2, 4), seq_len_buckets=(16, 128),
                           prefill_sizes=(16, 32))
    graphs = capture_graphs(llm.engine.runner, models, policy, 16, emulate=True)
    runners = graphs.registry.runners
    assert runners["target_prefill_16"].seq_len_buckets == (16, 128)
    assert runners["target_prefill_32"].seq_len_buckets == (128,)
    assert _run(llm) == want


def test_engine_capture_policy_sizes_prompt_graphs_from_the_engine():
    """One-sequence graphs up to prefill_graph_tokens (within the token budget), several
    sequences' up to a full budget of prompts beside max_num_seqs verifying requests (within
    mixed_graph_tokens), their prompts at most the largest one-sequence graph's length."""
    import torch

    from compiled_spec.compile import CompileConfig
    from compiled_spec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
    from compiled_spec.llm_compile import engine_capture_policy

    def policy(cc: CompileConfig, budget: int = 4096, seqs: int = 64, spec: bool = True):
        ec = EngineConfig(model="m", device=torch.device("cpu"), dtype=torch.float32,
                          max_model_len=2048, cache=CacheConfig(),
                          scheduler=SchedulerConfig(max_num_seqs=seqs,
                                                    max_num_batched_tokens=budget),
                          spec=SpecConfig(draft="d", num_speculative_tokens=5) if spec else None)
        return engine_capture_policy(cc, ec)

    p = policy(CompileConfig())
    assert p.prefill_sizes == (16, 32, 64, 128, 256, 512)
    assert p.mixed_sizes == (128, 256, 512, 1024, 2048, 4096, 4480) and p.mixed_query_len == 512
    p = policy(CompileConfig(), budget=1000, seqs=16, spec=False)
    assert p.mixed_sizes == (128, 256, 512, 1016) and p.prefill_sizes[-1] == 512
    p = policy(CompileConfig(prefill_graph_tokens=0, mixed_graph_tokens=300))
    assert p.prefill_sizes == () and p.mixed_sizes == (128, 256, 300) and p.mixed_query_len == 300
    p = policy(CompileConfig(mixed_graph_tokens=0))
    assert p.mixed_sizes == () and p.mixed_query_len == 0
    # 4 sequences of at most 512 tokens hold 2048: no size above it (each failed its capture)
    p = policy(CompileConfig(), seqs=4)
    assert p.mixed_sizes == (128, 256, 512, 1024, 2048) and p.mixed_query_len == 512
    from capture import StaticBuffers

    bufs = StaticBuffers(p.mixed_sizes[-1], 4, 8, torch.device("cpu"))
    for size in p.mixed_sizes:  # every size's dummy batch fits (the capture's own check)
        bufs.fill_dummy(size, 4, p.mixed_query_len, 2048)
    with pytest.raises(ValueError, match="mixed_graph_tokens"):
        CompileConfig(mixed_graph_tokens=-1)


def test_prefill_graphs_share_the_decode_graphs_compile(bigram_eagle3, smollm2_gguf_path):
    # One sequence in the prefill graphs' buffers made Dynamo specialize the metadata's sequence
    # dimension to 1: a whole target compile more at start-up (3 target graphs, not 2).
    target, _ = bigram_eagle3
    counts = []
    for sizes in ((), SIZES):
        llm = with_emulated_graphs(LLM(model=target, tokenizer=smollm2_gguf_path,
                                       max_model_len=128, max_num_seqs=4, page_size=4,
                                       num_kv_blocks=128), 0, prefill_sizes=sizes)
        counts.append(llm.compile_stats["target"]["graphs"])
    assert counts[0] == counts[1], counts


def test_batch_one_decode_and_prompt_graphs_compile_the_target_once(bigram_eagle3,
                                                                    smollm2_gguf_path, want):
    """Through Inductor (CPU): batch 1's decode graph (1 token, 1 sequence) and the prompt
    graphs share one target compile. Dynamo's 0/1 specialization (CompileConfig.size_oblivious
    off) and Inductor's lowering of a view of a non-contiguous slice (the decoder's qkv split,
    which asked whether T == 1) each made batch 1 a graph of its own: a second whole-target
    compile at start-up (~20 s on the H200). Fails with size_oblivious=False (2 graphs; not run
    in CI, for time: test_compile_guard checks the flag on a toy)."""
    from capture import CapturePolicy
    from compiled_spec.compile import CompileConfig, capture_graphs, compile_models

    target, _ = bigram_eagle3
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, max_num_seqs=1,
              page_size=4, num_kv_blocks=64)
    models = compile_models(llm.engine.runner, CompileConfig())
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=1, num_speculative_tokens=0, max_model_len=128,
                           batch_sizes=(1,), seq_len_buckets=(128,), prefill_sizes=(16,))
    capture_graphs(llm.engine.runner, models, policy, 4, emulate=True)
    assert len(models.backends["target"].graphs) == 1
    assert _run(llm) == want  # the prompts one at a time: this engine holds one
