"""A sampled step's draws by graph replay (engine/sample_graph.py): the same tokens as the eager
coupled draw for greedy, temperature, top-k and top-p requests mixed, at every captured width
and padded batch size; the batches no graph takes run eagerly and are counted under their
reason; an engine's sampled decode and early chain steps replay them and still give vanilla
sampling's tokens. CPU, emulated graphs."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.engine.sample_graph import SampleGraphs
from compiled_spec.engine.sampled_accept import _target_probs
from compiled_spec.spec.rejection import coupled_tokens
from tests.engine_runs import generate_in_batches, with_emulated_graphs

V = 96
KINDS = [dict(temperature=0.0), dict(temperature=0.9), dict(temperature=0.7, top_k=5),
         dict(temperature=1.3, top_p=0.8), dict(temperature=0.5, top_k=3, top_p=0.9)]


def _reqs(kinds: list[dict], seed: int) -> list[SimpleNamespace]:
    """What the draws read of a request: its params, seed and token count."""
    return [SimpleNamespace(params=SamplingParams(max_tokens=4, **kw), seed=seed * 7919 + i,
                            num_tokens=11 + 3 * i) for i, kw in enumerate(kinds)]


def _eager(reqs: list, logits: torch.Tensor) -> torch.Tensor:
    return coupled_tokens(*_target_probs(SimpleNamespace(device=torch.device("cpu")), reqs,
                                         logits))


@pytest.fixture(scope="module")
def graphs() -> SampleGraphs:
    g = SampleGraphs((1, 2, 4), (1, 4), V, torch.device("cpu"), emulate=True)
    g.capture()
    return g


def test_graph_draws_equal_eager_draws(graphs):
    g = graphs
    assert sorted(g._graphs) == [(t, s) for t in (1, 2, 4, 8, 16) for s in (False, True)]
    gen = torch.Generator().manual_seed(0)
    checked = set()
    for trial in range(12):
        n = 1 + trial % 4
        w = (1, 4)[trial % 2]
        kinds = [KINDS[(trial + i) % len(KINDS)] for i in range(n)]
        if trial % 3 == 0:  # no filter that sorts: the plain graphs
            kinds = [k for k in kinds if "top_k" not in k and "top_p" not in k] or [KINDS[1]]
            n = len(kinds)
        reqs = _reqs(kinds, trial)
        logits = 3 * torch.randn(n, w, V, generator=gen)
        if trial % 4 != 1:  # a replay's model-dtype logits; else an eager readout's fp32
            logits = logits.bfloat16()
        replays = g.graph_replays
        got = g.draw(reqs, logits)
        assert got is not None and g.graph_replays == replays + 1
        assert torch.equal(got, _eager(reqs, logits)), (trial, kinds)
        checked.add((w, any(r.params.needs_sorting for r in reqs)))
    assert checked == {(w, s) for w in (1, 4) for s in (False, True)}
    assert g.padded_rows > 0  # (3 requests padded to 4)
    assert g.eager_fallbacks == 0


def test_draws_no_graph_takes_are_counted(graphs):
    g = graphs
    before = dict(g.fallback_reasons)
    logits = torch.randn(2, 1, V).bfloat16()
    assert g.draw(_reqs([KINDS[1], dict(temperature=0.8, min_p=0.1)], 0), logits) is None
    assert g.draw(_reqs([KINDS[1]] * 2, 0), logits.double()) is None
    assert g.draw(_reqs([KINDS[1]] * 5, 0), torch.randn(5, 4, V).bfloat16()) is None  # 20 rows
    got = {k: g.fallback_reasons.get(k, 0) - before.get(k, 0) for k in g.fallback_reasons}
    assert got == {"min_p": 1, "dtype": 1, "size": 1}
    assert g.stats()["eager_fallbacks"] == sum(g.fallback_reasons.values())


@pytest.mark.parametrize("k,early", [(0, True), (3, True), (3, False)])
def test_engine_sampled_steps_replay_and_equal_vanilla(bigram_eagle3, smollm2_gguf_path, k,
                                                       early):
    """Vanilla (k = 0: its decode steps) and EAGLE-3 chain engines (k = 3: early steps' k + 1
    draws, or late steps' acceptance, ``sampled_accept``): sampled requests' tokens equal
    vanilla sampling's without graphs, the draws were replayed, and a min-p request's steps
    ran eagerly, said in the stats."""
    target, head = bigram_eagle3
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, max_num_seqs=4,
              page_size=4, num_kv_blocks=160)
    prompts = [[(5 * i + j) % 60 + 2 for j in range(4 + 3 * i)] for i in range(6)]
    sps = [SamplingParams(max_tokens=12, ignore_eos=True, seed=40 + i, temperature=0.8,
                          top_p=0.9 if i % 3 == 1 else 1.0, top_k=4 if i % 3 == 2 else 0)
           for i in range(6)]
    sps[5].min_p, sps[5].top_p, sps[5].top_k = 0.2, 1.0, 0
    want = generate_in_batches(LLM(**kw), prompts, sps, 3)
    spec = {} if k == 0 else dict(draft=head, num_speculative_tokens=k)
    llm = with_emulated_graphs(LLM(**kw, **spec), k)
    if not early:
        llm.engine.runner.early.enabled = False
    got = generate_in_batches(llm, prompts, sps, 3)
    assert got == want
    st = llm._compiled.graphs.stats()["components"][SampleGraphs.name]
    assert st["graph_replays"] >= 10
    assert set(st["fallback_reasons"]) == {"min_p"}
    if k:  # the chain's k + 1 rows per request took graphs too (early or late steps)
        ep = llm.stats.early_propose.as_dict()
        assert (ep["early"] > 0) == early and (ep["late"] > ep["early"]) != early, ep


def test_sample_graphs_off_draws_eagerly(bigram_eagle3, smollm2_gguf_path):
    """CompileConfig(sample_graphs=False): no sample graphs registered, the draws eager, the
    same tokens; a non-bool is refused by name."""
    from capture import CapturePolicy
    from compiled_spec.compile import CompileConfig, capture_graphs, compile_models

    target, _ = bigram_eagle3
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, max_num_seqs=2,
              page_size=4, num_kv_blocks=64)
    sps = [SamplingParams(max_tokens=6, ignore_eos=True, seed=3 + i, temperature=0.9)
           for i in range(2)]
    want = LLM(**kw).generate([[5, 6, 7], [8, 9]], sps, use_tqdm=False)
    llm = LLM(**kw)
    models = compile_models(llm.engine.runner, CompileConfig(inductor=False, sample_graphs=False))
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=2, num_speculative_tokens=0, max_model_len=64,
                           batch_sizes=(1, 2), seq_len_buckets=(64,))
    graphs = capture_graphs(llm.engine.runner, models, policy, 4, emulate=True)
    assert SampleGraphs.name not in graphs.registry.runners
    assert llm.engine.runner.sample_graph is None
    got = llm.generate([[5, 6, 7], [8, 9]], sps, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    with pytest.raises(ValueError, match="CompileConfig.sample_graphs=1"):
        CompileConfig(sample_graphs=1)


@pytest.mark.parametrize("inductor", [False, pytest.param(True, marks=pytest.mark.heavy)])
def test_compiled_draws_equal_eager_draws(inductor):
    """CompileConfig(sample_compile=True): the graphs capture ``draw_tokens`` compiled by our
    backend (Inductor's fused kernels, or without Inductor), one compile per sorting mode
    over every captured size, and draw the eager coupled tokens."""
    from compiled_spec.compile import CompileConfig, compile_callable, inductor_config
    from passes.pipeline import make_backend
    from compiled_spec.engine.sample_graph import draw_tokens

    cfg = CompileConfig(inductor=inductor, sample_compile=True)
    backend = make_backend(inductor=inductor, inductor_config=inductor_config(cfg),
                           hoist_fc=False, per_layer_metadata=False)
    fn = compile_callable(draw_tokens, backend, cfg)
    g = SampleGraphs((1, 3), (1, 2), V, torch.device("cpu"), emulate=True)
    g.draw_fn = fn
    g.capture()
    assert sorted(g._graphs) == [(t, s) for t in (1, 2, 3, 6) for s in (False, True)]
    # per sorting mode one graph for every row count (dynamic, size-oblivious), or with
    # Inductor two: its lowering guards 2 <= rows, so one row compiles on its own; none failed
    assert len(backend.graphs) == (4 if inductor else 2) and fn.guard.failures == {}
    gen = torch.Generator().manual_seed(1)
    for trial in range(8):
        n, w = 1 + trial % 3, (1, 2)[trial % 2]
        kinds = [KINDS[(trial + i) % len(KINDS)] for i in range(n)]
        reqs = _reqs(kinds, trial)
        logits = (3 * torch.randn(n, w, V, generator=gen)).bfloat16()
        replays = g.graph_replays
        got = g.draw(reqs, logits)
        assert got is not None and g.graph_replays == replays + 1
        assert torch.equal(got, _eager(reqs, logits)), (trial, kinds)
    assert g.eager_fallbacks == 0


def test_engine_with_compiled_draws_equals_vanilla(bigram_eagle3, smollm2_gguf_path):
    """An engine compiled with sample_compile=True: its sample graphs captured the compiled
    draw (the backend's graphs), its sampled tokens are vanilla sampling's without graphs."""
    from capture import CapturePolicy
    from compiled_spec.compile import CompileConfig, capture_graphs, compile_models

    target, _ = bigram_eagle3
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, max_num_seqs=2,
              page_size=4, num_kv_blocks=64)
    sps = [SamplingParams(max_tokens=6, ignore_eos=True, seed=3 + i, temperature=0.9,
                          top_p=0.8 if i else 1.0) for i in range(2)]
    want = LLM(**kw).generate([[5, 6, 7], [8, 9]], sps, use_tqdm=False)
    llm = LLM(**kw)
    models = compile_models(llm.engine.runner,
                            CompileConfig(inductor=False, sample_compile=True))
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=2, num_speculative_tokens=0, max_model_len=64,
                           batch_sizes=(1, 2), seq_len_buckets=(64,))
    graphs = capture_graphs(llm.engine.runner, models, policy, 4, emulate=True)
    assert graphs.sample.draw_fn is models.compiled["sample_draw"]
    assert len(models.backends["sample_draw"].graphs) == 2  # plain and sorting
    got = llm.generate([[5, 6, 7], [8, 9]], sps, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert graphs.sample.graph_replays > 0
    with pytest.raises(ValueError, match="CompileConfig.sample_compile=1"):
        CompileConfig(sample_compile=1)
