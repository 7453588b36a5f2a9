"""The engine's CUDA-graph routing, on the CPU through emulated graphs (``capture.emulate``):
every target decode / verify, draft first pass and k-1 step draft loop is padded into static
buffers and "replayed" with the captured host ints, and must give exactly the eager engine's
output and acceptance. Real CUDA graphs are checked on the H200 by profiles/scripts/graphs_h200.py."""
from __future__ import annotations

import pytest

from capture import CaptureError, CapturePolicy
from compiled_spec import LLM, SamplingParams
from compiled_spec.compile import CompileConfig, capture_graphs, compile_models, use_compiled
from compiled_spec.engine.graphs import EngineGraphs
from compiled_spec.engine.propose_graph import ProposeGraphs

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 2], [11, 12], [6, 6, 6, 1, 2]]


def _llm(target: str, tok: str, draft: str | None, **kw) -> LLM:
    return LLM(model=target, tokenizer=tok, draft=draft, max_model_len=128, max_num_seqs=4,
               **({"num_speculative_tokens": 3} if draft else {}), **kw)


def _graphs(llm: LLM, batch_sizes=(1, 2, 4), buckets=(32, 128)) -> EngineGraphs:
    """Compile (our passes, no Inductor: fast) and capture emulated graphs."""
    cfg = llm.config
    models = compile_models(llm.engine.runner, CompileConfig(inductor=False))
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=0 if cfg.spec is None else
                           cfg.spec.num_speculative_tokens, max_model_len=128,
                           batch_sizes=batch_sizes, seq_len_buckets=buckets,
                           verify_widths=() if cfg.spec is None else cfg.spec.adaptive_k)
    return capture_graphs(llm.engine.runner, models, policy, cfg.cache.page_size, emulate=True)


def _run(llm: LLM, sp: SamplingParams | list[SamplingParams]):
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_every_compiled_callable_gets_the_gemm_autotuning_patch(trained_eagle3_pair,
                                                                smollm2_gguf_path):
    """``CompileConfig.autotune_gemm`` reaches the backend of the target and of every draft
    callable (one engine, one Inductor config)."""
    from compiled_spec.compile import inductor_config

    target, head = trained_eagle3_pair
    llm = _llm(target, smollm2_gguf_path, head)
    cfg = CompileConfig(inductor=False, autotune_gemm=True)
    models = compile_models(llm.engine.runner, cfg)
    assert set(models.backends) >= {"target", "draft_first_pass", "draft_step_pick"}
    for name, backend in models.backends.items():
        assert backend.inductor_config == inductor_config(cfg), name
    plain = compile_models(llm.engine.runner, CompileConfig(inductor=False))
    assert all(b.inductor_config == {} for b in plain.backends.values())


@pytest.mark.parametrize("sampled", [False, True])
def test_graphed_speculative_engine_equals_eager(trained_eagle3_pair, smollm2_gguf_path, sampled):
    target, head = trained_eagle3_pair
    llm = _llm(target, smollm2_gguf_path, head,
               draft_sampling="sample" if sampled else "argmax")
    # Different budgets: requests end at different steps, so batches of 3 pad to 4.
    sp = [SamplingParams(max_tokens=m, temperature=0.8, seed=5, ignore_eos=True) if sampled
          else SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
          for m in (24, 24, 9, 40, 6)]
    eager = _run(llm, sp)
    eager_tau = llm.stats.spec.mean_acceptance_length
    graphs = _graphs(llm)
    assert set(graphs.registry.runners) == {"target_decode", "target_verify", "draft_propose",
                                            "draft_propose_early", "sample_draw"}
    before = llm.stats.spec.num_drafting_steps
    graphed = _run(llm, sp)
    assert graphed == eager
    st = graphs.stats()["components"]
    for name in ("target_verify", "draft_propose"):
        assert st[name]["graph_replays"] > 0, (name, st[name])
    # each component's capture timed (its dummy runs at least: never zero)
    assert all(c["capture_s"] > 0 for c in st.values()), st
    assert st["target_decode"]["prefill_calls"] > 0  # prefill never replays, and is counted
    assert graphs.stats()["padded_rows"] > 0  # batches of 3 pad to 4
    assert llm.stats.spec.num_drafting_steps > before
    # Same acceptance as eager over the graphed run alone (the counters are cumulative).
    if not sampled:
        assert llm.stats.spec.mean_acceptance_length == pytest.approx(eager_tau, abs=1e-9)
        assert eager_tau >= 2.0
    use_compiled(llm.engine.runner, llm._compiled, False)  # back to eager: graphs not used
    replays = graphs.stats()["replayed"]
    assert _run(llm, sp) == eager and graphs.stats()["replayed"] == replays
    graphs.reset_counts()  # what start-up's end does (compile.end_startup), early graphs too
    st = graphs.stats()["components"]
    assert all(c["graph_replays"] == 0 and c["fallback_reasons"] == {}
               for c in st.values()), st


def test_one_request_decodes_through_the_verify_graph(trained_eagle3_pair, smollm2_gguf_path):
    """A chain engine captures no 1-token decode graph (it would be a target compile of its
    own): a single request's decode step (the first after its prefill) replays the batch-1
    verify graph with inert padding rows, and the output stays exactly eager's."""
    target, head = trained_eagle3_pair
    llm = _llm(target, smollm2_gguf_path, head)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[3, 7, 1], [9, 2, 4, 4, 8]]
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], sp, use_tqdm=False)]
    eager += [o.outputs[0].token_ids for o in llm.generate(prompts[1:], sp, use_tqdm=False)]
    graphs = _graphs(llm, batch_sizes=(1,))
    assert graphs.registry.runners["target_decode"].sizes == []
    assert "target_decode" not in graphs.required and "target_verify" in graphs.required
    graphed, before = [], llm.stats.spec.num_drafting_steps
    for prompt in prompts:  # one request at a time: every step has batch size 1
        graphed += [o.outputs[0].token_ids for o in llm.generate([prompt], sp, use_tqdm=False)]
    assert graphed == eager
    st = graphs.stats()["components"]
    assert st["target_decode"]["graph_replays"] == 0
    assert st["target_decode"]["eager_fallbacks"] == 0  # no decode step went without a graph
    # The verify steps and the decode steps without drafts all replayed the batch-1 verify
    # graph: more replays than the graphed run's drafting steps.
    drafting = llm.stats.spec.num_drafting_steps - before
    assert st["target_verify"]["graph_replays"] > drafting > 0
    assert graphs.stats()["without_graph"].get("target_verify", {}) == {}


def test_uncaptured_sizes_run_without_graph_and_are_counted(trained_eagle3_pair,
                                                           smollm2_gguf_path):
    target, head = trained_eagle3_pair
    llm = _llm(target, smollm2_gguf_path, head)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    eager = _run(llm, sp)
    graphs = _graphs(llm, batch_sizes=(1, 2))  # batches of 3-4 have no graph
    assert _run(llm, sp) == eager
    missed = graphs.stats()["without_graph"]
    assert missed["target_verify"].get("size", 0) > 0 and missed["draft_propose"].get("size", 0) > 0


def test_vanilla_engine_decode_graph(trained_eagle3_pair, smollm2_gguf_path):
    target, _ = trained_eagle3_pair
    llm = _llm(target, smollm2_gguf_path, None)
    sp = SamplingParams(max_tokens=12, temperature=0.7, seed=3, ignore_eos=True)
    eager = _run(llm, sp)
    graphs = _graphs(llm)
    # k = 0: verify is decode
    assert set(graphs.registry.runners) == {"target_decode", "sample_draw"}
    assert _run(llm, sp) == eager
    assert graphs.stats()["components"]["target_decode"]["graph_replays"] > 0, graphs.stats()


def test_draft_missing_from_capture_is_detected(trained_eagle3_pair, smollm2_gguf_path,
                                                 monkeypatch):
    """seeds/003's bug: the draft's graphs never captured. Capture must refuse to start."""
    target, head = trained_eagle3_pair
    llm = _llm(target, smollm2_gguf_path, head)

    def broken(self, size):  # every dummy run of the draft fails
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(ProposeGraphs, "_capture_one", broken)
    with pytest.warns(RuntimeWarning, match="draft_propose"):
        with pytest.raises(CaptureError, match="draft_propose"):
            _graphs(llm)


def test_self_distillation_chunk_counts_graph_replays(trained_eagle3_pair, smollm2_gguf_path):
    """The data phase's per-chunk line says how its engine steps ran: replays, prefill steps
    (never captured) and other misses; an eager engine has none of them to report."""
    from compiled_spec.train.multiturn import _graph_calls

    target, _ = trained_eagle3_pair
    llm = _llm(target, smollm2_gguf_path, None)
    assert _graph_calls(llm) == (0, 0, 0)
    _graphs(llm, batch_sizes=(1, 2), buckets=(128,))  # batches of 3 and 4 find no graph
    llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    replays, prefill, misses = _graph_calls(llm)
    assert replays > 0 and prefill > 0 and misses > 0, (replays, prefill, misses)


def test_engines_that_pause_capture_a_one_request_decode_graph(trained_eagle3_pair,
                                                                smollm2_gguf_path):
    """A paused step of one request decodes one token: an adaptive engine replays a decode
    graph of one row for it (size 1 stays symbolic, so it compiles nothing), not the batch-1
    verify graph padded from 1 + k rows; an always-drafting engine, which decodes alone only
    after a prompt, keeps that padding and one capture fewer. Output stays vanilla's."""
    from compiled_spec.spec.policy import PLAIN, SPEC
    from tests.policy_stub import ModesInTurn

    target, head = trained_eagle3_pair
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    one = [PROMPTS[0]]
    want = [o.outputs[0].token_ids for o in _llm(target, smollm2_gguf_path, None)
            .generate(one, sp, use_tqdm=False)]
    sizes = {}
    for policy in ("adaptive", "always"):
        llm = _llm(target, smollm2_gguf_path, head, speculation_policy=policy,
                   verify_ahead=True)
        graphs = _graphs(llm)
        if policy == "adaptive":
            llm.engine.stats.policy = ModesInTurn([SPEC] * 2 + [PLAIN] * 30)
        got = [o.outputs[0].token_ids for o in llm.generate(one, sp, use_tqdm=False)]
        assert got == want, policy
        st = graphs.stats()["components"]
        sizes[policy] = st["target_decode"]["captured_sizes"]
        if policy == "adaptive":  # the paused steps: the one-row graph, not the verify graph
            assert st["target_decode"]["graph_replays"] >= 15, st["target_decode"]
            assert st["target_verify"]["graph_replays"] <= 5, st["target_verify"]
    assert sizes == {"adaptive": [1, 2, 4], "always": [2, 4]}, sizes


def test_adaptive_policy_with_graphs_equals_eager_and_counts_its_pauses(trained_eagle3_pair,
                                                                       smollm2_gguf_path,
                                                                       monkeypatch):
    """speculation_policy="adaptive" on the graphed engine: paused steps replay the target's
    decode graph and a graph of the draft's first pass alone, drafting steps keep the early
    proposal and the verify launched ahead (the policy decides before the step: the H200's
    seventeenth-session bench had adaptive 12-18% slower than always-drafting when it decided
    after and so ran every step late), and the output is the eager always-drafting engine's."""
    from compiled_spec.spec.policy import SpecPolicy

    target, head = trained_eagle3_pair
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = _run(_llm(target, smollm2_gguf_path, head), sp)
    llm = _llm(target, smollm2_gguf_path, head, speculation_policy="adaptive", verify_ahead=True)
    graphs = _graphs(llm)
    llm.engine.stats.policy = SpecPolicy(warmup=2, probe_every=4, probe_len=1)
    import compiled_spec.engine.propose_graph as pg

    loops, real_rows = [], pg.loop_rows  # the draft loop's rows each staging builds
    monkeypatch.setattr(pg, "loop_rows", lambda *a: loops.append(a[-1]) or real_rows(*a))
    assert _run(llm, sp) == eager
    # a paused step stages no draft loop: its first pass replays the sync graphs, whose
    # staging has none (engine/sync_graph.py); proposals stage their k - 1 loop steps
    assert set(loops) == {llm.engine.runner.k - 1}, loops
    st = graphs.stats()
    assert st["components"]["draft_sync"]["graph_replays"] > 0
    # paused steps replay the target's decode graph and the draft's first-pass-only graph
    assert st["components"]["target_decode"]["graph_replays"] > 0
    assert sorted(graphs.sync._graphs) == [1, 2, 4]
    summary = llm.stats.policy.summary()[4]
    assert summary["paused_steps"] > 0 and summary["drafted_steps"] > 0
    assert "paused (first pass only)" not in st["without_graph"].get("draft_sync", {})
    early = llm.stats.early_propose
    assert early.early > 0 and early.late_reasons.get("paused", 0) > 0, early
    assert llm.stats.verify_ahead.taken > 0, llm.stats.verify_ahead
    # ... and one that no graph fits runs uncaptured, and is counted so
    graphs.sync._graphs.clear()
    assert _run(llm, sp) == eager
    assert graphs.stats()["without_graph"]["draft_sync"]["paused (first pass only)"] > 0


def test_shrunk_k_replays_verify_graphs_of_its_own(trained_eagle3_pair, smollm2_gguf_path):
    """adaptive_k on the graphed engine: steps that verify 1 of the 3 drafts replay the
    1 + 1-row verify graph (a 4-row one would pad them back to full cost), propose late (the
    early graph stages k + 1 verified rows) and launch no verify ahead (it would verify k), and
    every mix of full, shrunk and paused steps gives the eager always-drafting output."""
    from compiled_spec.spec.policy import PLAIN, SPEC, shrunk
    from tests.policy_stub import ModesInTurn

    target, head = trained_eagle3_pair
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eager = _run(_llm(target, smollm2_gguf_path, head), sp)
    llm = _llm(target, smollm2_gguf_path, head, speculation_policy="adaptive", adaptive_k=(1,),
               verify_ahead=True)
    graphs = _graphs(llm)
    assert "target_verify_k1" in graphs.required
    assert graphs.registry.runners["target_verify_k1"].sizes == [2, 4, 8]
    llm.engine.stats.policy = ModesInTurn([SPEC, SPEC, shrunk(1), shrunk(1), shrunk(1),
                                           PLAIN])
    assert _run(llm, sp) == eager
    st = graphs.stats()
    assert st["components"]["target_verify_k1"]["graph_replays"] > 0
    assert st["components"]["target_verify"]["graph_replays"] > 0
    assert "target_verify_k1" not in st["without_graph"], st["without_graph"]
    early, ahead = llm.stats.early_propose, llm.stats.verify_ahead
    assert early.early > 0 and early.late_reasons.get("shrunk", 0) > 0, early
    assert ahead.taken > 0 and ahead.skipped.get("shrunk", 0) > 0, ahead


@pytest.mark.parametrize("tree", [False, True])
def test_fc_is_issued_before_the_acceptance_waits(trained_eagle3_pair, smollm2_gguf_path,
                                                  monkeypatch, tree):
    """EAGLE-3's fc over a decode step's target rows is issued right after the verify forward,
    before the host reads the acceptance back (it does not depend on it), and the graphed
    propose that follows takes that output instead of running fc again. Outputs stay the
    eager engine's."""
    import torch

    from compiled_spec.engine.model_runner import ModelRunner
    from compiled_spec.engine.tree_runner import TreeModelRunner
    from compiled_spec.spec.proposer import EagleProposer

    target, head = trained_eagle3_pair
    kw = dict(speculative_topk=2, speculative_num_draft_tokens=6) if tree else {}
    llm = _llm(target, smollm2_gguf_path, head, **kw)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    eager = _run(llm, sp)
    _graphs(llm)
    # The late path's order; an early step takes the fc before the read (chains:
    # tests/test_early_propose.py, trees: tests/test_early_tree.py).
    llm.engine.runner.early.enabled = False
    events: list[str] = []
    pre, comb = EagleProposer.precombine, EagleProposer.combine

    inside = []  # non-empty while precombine runs (its own combine call is not a propose's)

    def precombine(self, target_hidden, active=None, out=None):  # noqa: ANN001
        inside.append(1)
        try:
            pre(self, target_hidden, active, out)
        finally:
            inside.pop()
        if self._pre is not None:
            events.append("fc issued")

    def combine(self, target_hidden):  # noqa: ANN001
        if inside:
            return comb(self, target_hidden)
        hit = self._pre is not None and self._pre[0] is target_hidden
        events.append("fc taken" if hit else "fc run now")
        return comb(self, target_hidden)
    monkeypatch.setattr(EagleProposer, "precombine", precombine)
    monkeypatch.setattr(EagleProposer, "combine", combine)
    # The step's host read of the acceptance: the greedy verification on the host (chains),
    # numpy's view of the copied-back trees (trees).
    if tree:
        orig = TreeModelRunner._execute_tree

        def spy_tree(self, reqs):  # noqa: ANN001
            real = torch.Tensor.numpy

            def numpy(t):  # noqa: ANN001
                events.append("acceptance read")
                return real(t)
            with monkeypatch.context() as m:
                m.setattr(torch.Tensor, "numpy", numpy)
                return orig(self, reqs)
        monkeypatch.setattr(TreeModelRunner, "_execute_tree", spy_tree)
    else:
        orig_acc = ModelRunner._greedy_accept_host

        def spy(self, *a):  # noqa: ANN001, ANN002
            events.append("acceptance read")
            return orig_acc(self, *a)
        monkeypatch.setattr(ModelRunner, "_greedy_accept_host", spy)
    assert _run(llm, sp) == eager
    taken = [i for i, e in enumerate(events) if e == "fc taken"]
    assert len(taken) > 3, events
    for i in taken:  # issued, then the acceptance read, then taken by the propose
        assert events[i - 2:i] == ["fc issued", "acceptance read"], events[i - 3:i + 1]
    # Decode steps never run the fc a second time: only proposals after a prefill do.
    assert events.count("fc run now") <= 2 * len(PROMPTS), events


@pytest.mark.parametrize("spec", [False, True])
def test_decode_and_verify_graphs_compute_the_logits(trained_eagle3_pair, smollm2_gguf_path,
                                                     spec, monkeypatch):
    """The lm_head is captured with the decode / verify graphs: their steps read the replay's
    logits (no eager readout on the step's host path), prompt steps still read out eagerly,
    and the output stays eager's (greedy and sampled requests in one batch)."""
    target, head = trained_eagle3_pair
    llm = _llm(target, smollm2_gguf_path, head if spec else None)
    sp = [SamplingParams(max_tokens=m, temperature=t, seed=3, ignore_eos=True)
          for m, t in ((20, 0.0), (12, 0.7), (9, 0.0), (16, 0.0), (5, 0.9))]
    eager = _run(llm, sp)
    _graphs(llm)
    model = llm.engine.runner.model
    calls: list[int] = []
    readout = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: calls.append(h.shape[0]) or readout(h))
    steps0 = llm.stats.num_steps
    prompt_steps0 = llm.stats.num_prefill_steps
    assert _run(llm, sp) == eager
    steps = llm.stats.num_steps - steps0
    prompt_steps = llm.stats.num_prefill_steps - prompt_steps0
    # Eager readouts only in steps that carried a prompt (the padded batches of 3 included).
    assert 0 < len(calls) <= prompt_steps < steps, (calls, prompt_steps, steps)


@pytest.mark.parametrize("spec", [False, True])
def test_bf16_graph_logits_give_eagers_tokens(trained_eagle3_pair, smollm2_gguf_path, spec):
    """In bf16 the graphs hand their logits on in bf16 (greedy steps take the argmax, which the
    exact upcast cannot change; sampling and logprobs upcast first): greedy, sampled and
    logprob-reading requests in one batch give the eager engine's tokens and logprobs."""
    target, head = trained_eagle3_pair
    llm = _llm(target, smollm2_gguf_path, head if spec else None, dtype="bfloat16")
    sp = [SamplingParams(max_tokens=m, temperature=t, seed=3, ignore_eos=True, logprobs=lp)
          for m, t, lp in ((20, 0.0, None), (12, 0.7, None), (9, 0.0, 2), (16, 0.0, None),
                           (5, 0.9, None))]

    def run():
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], outs[2].outputs[0].logprobs

    eager, eager_lp = run()
    _graphs(llm)
    graphed, graphed_lp = run()
    assert graphed == eager
    assert graphed_lp == eager_lp and len(eager_lp) == 9
