"""Paused steps defer the draft's first pass (compiled_spec/engine/deferred_first_pass.py): the
output stays vanilla's, the draft's KV and the acceptance stay those of engines whose paused
steps run the first pass every step, and ``paused_flush_depth`` paused steps share one
first-pass replay."""
import math

import pytest
import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.engine.deferred_first_pass import DeferredFirstPass, flush_depth
from compiled_spec.engine.sync_graph import SyncGraphs
from compiled_spec.engine.verify_ahead import VerifyAhead
from compiled_spec.spec.policy import PLAIN, SPEC, SpecPolicy
from tests.engine_runs import assert_same_logprobs, with_emulated_graphs
from tests.policy_stub import ModesInTurn
from tests.spec_models import write_bigram_target, write_mirror_eagle1

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 2], [11, 12]]
# Budgets that end requests in the middle of pauses (their deferred rows are dropped)
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 23, 31, 40)]
# Pauses longer than two full rings (k = 3, depth 4: 5 slots), then drafting again
MODES = [SPEC] * 2 + [PLAIN] * 13
K = 3
DEPTH = K + 1  # paused steps per flush here (the default, 32, would need far longer pauses)


@pytest.fixture(scope="module")
def eagle1_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("deferred")
    target = write_bigram_target(root / "target", layers=2)
    return target, write_mirror_eagle1(root / "noisy", target, noise=0.3)


def _vanilla(target, tok) -> list[list[int]]:
    return [o.token_ids for o in LLM(model=target, tokenizer=tok, max_model_len=128)
            .generate(PROMPTS, PARAMS)]


def _run(target, head, tok, defer: bool, ahead: bool, monkeypatch, modes=MODES, **kw):
    """(outputs, the draft's K rows per request over the positions every first pass has
    covered by its end, the LLM, first-pass graph calls, fc calls), emulated graphs."""
    llm = with_emulated_graphs(LLM(
        model=target, tokenizer=tok, max_model_len=128, draft=head, num_speculative_tokens=K,
        speculation_policy="adaptive", verify_ahead=ahead, max_num_seqs=4,
        defer_paused_first_pass=defer, **{"paused_flush_depth": DEPTH, **kw}), k=K)
    eng = llm.engine
    eng.stats.policy = ModesInTurn(modes)
    tables, free = {}, eng.allocator.free

    def keep_table(req_id):
        tables[req_id] = list(eng.allocator.tables.get(req_id, ()))
        return free(req_id)

    calls = {"sync": 0, "fc": 0}
    real_sync, real_fc = SyncGraphs.run, eng.draft.combine_aux

    def count_sync(self, *a, **k):
        calls["sync"] += 1
        return real_sync(self, *a, **k)

    def count_fc(*a, **k):
        calls["fc"] += 1
        return real_fc(*a, **k)

    monkeypatch.setattr(SyncGraphs, "run", count_sync)
    monkeypatch.setattr(eng.draft, "combine_aux", count_fc)
    eng.allocator.free = keep_table
    outs = llm.generate(PROMPTS, PARAMS)
    page = eng.allocator.page_size
    k_cache = eng.kv_caches[eng.model.config.num_hidden_layers][0]  # the draft layer's K
    kv = []
    for o, p in zip(outs, PROMPTS):
        n = len(p) + len(o.token_ids) - 12  # a finished request's last rows stay deferred
        table = tables[o.request_id]
        kv.append(torch.stack([k_cache[table[q // page], q % page] for q in range(n)]))
    monkeypatch.undo()
    return [o.token_ids for o in outs], kv, llm, calls


def _spy_order(monkeypatch) -> list[str]:
    """The order of deferrals, flushes (with their reason) and launched-ahead target forwards."""
    events: list[str] = []
    for cls, name, label in ((DeferredFirstPass, "defer", lambda *a, **k: "defer"),
                             (DeferredFirstPass, "_flush", lambda self, why, *a, **k:
                              f"flush {why}"),
                             (VerifyAhead, "_launch", lambda *a, **k: "launch")):
        def spy(*a, _real=getattr(cls, name), _label=label, **k):
            events.append(_label(*a, **k))
            return _real(*a, **k)
        monkeypatch.setattr(cls, name, spy)
    return events


@pytest.mark.parametrize("ahead,depth,behind", [(False, DEPTH, True), (True, 5, True),
                                                (True, 5, False)])
def test_deferred_first_pass_keeps_output_kv_and_acceptance(trained_eagle3_pair,
                                                            smollm2_gguf_path, monkeypatch,
                                                            ahead, depth, behind):
    """EAGLE-3 (the aux states as a list, fc in the flush): late and launched-ahead paused
    steps. Full rings flush from the first-pass graph (of k + 1 rows per request as the
    propose graphs, or of more), a change to drafting flushes eagerly, requests ending
    mid-pause drop their rows, and the paused steps issue no fc."""
    target, head = trained_eagle3_pair
    want = _vanilla(target, smollm2_gguf_path)
    ref_ids, ref_kv, ref, ref_calls = _run(target, head, smollm2_gguf_path, False, ahead,
                                           monkeypatch)
    events = _spy_order(monkeypatch)  # (undone by _run)
    ids, kv, llm, calls = _run(target, head, smollm2_gguf_path, True, ahead, monkeypatch,
                               paused_flush_depth=depth, flush_behind_launch=behind)
    prop = llm.engine.runner.proposer
    assert prop.sync_graph.q == depth and prop.graph.q == K + 1
    assert llm.engine.runner.deferred.slots == depth + 1
    assert ids == ref_ids == want
    for got, exp in zip(kv, ref_kv):
        torch.testing.assert_close(got, exp, rtol=1e-5, atol=1e-5)
    assert llm.stats.spec.accepted_per_position == ref.stats.spec.accepted_per_position
    assert ref.stats.deferred_first_pass is None
    st = llm.stats.deferred_first_pass.as_dict()
    assert st["deferred_steps"] > 20 and st["flush_reasons"]["full"] >= 4, st
    assert st["flush_reasons"]["draft"] >= 2 and st["dropped_rows"] > 0, st
    # every flush replays a graph, a change to drafting's too (the first-pass graphs have
    # their own pool and buffers: the launched verify's outputs stay intact, as ``ids`` shows)
    assert st["eager_flushes"] == 0 and st["flushes"] > st["flush_reasons"]["full"], st
    # one first-pass replay per ring and per change of mode, not per paused step
    assert calls["sync"] < ref_calls["sync"] / 2, (calls, ref_calls)
    assert calls["fc"] < ref_calls["fc"], (calls, ref_calls)
    assert st["flush_ms"] > 0, st  # the flushes' host time, reported
    # A full ring's flush runs behind the next target forward's launch, not before it: in a
    # late engine at the next deferral; launched ahead, right after the launch (or at the next
    # deferral where a step ran late). It ran inside the deferral that filled the ring before.
    full = [i for i, e in enumerate(events) if e == "flush full"]
    assert len(full) == st["flush_reasons"]["full"], events
    after = [events[i - 1] for i in full]
    assert set(after) <= {"launch", "defer"}, after
    if not behind:  # flush_behind_launch=False: inside the deferral that filled the ring
        assert set(after) == {"defer"}, [events[i - 3:i + 2] for i in full]
        nxt = [events[i + 1] for i in full if i + 1 < len(events)]
        assert nxt.count("launch") >= len(full) - 1, [events[i - 2:i + 2] for i in full]
    elif ahead:
        assert after.count("launch") >= len(full) - 1, [events[i - 3:i + 1] for i in full]
    else:  # from an empty ring: a deferral per slot, then the next one's flushes it
        last = [max((j for j in range(i) if events[j].startswith("flush")), default=0)
                for i in full]
        fresh = [events[j:i] for j, i in zip(last, full) if events[j] != "flush full"]
        assert fresh and all(seg.count("defer") == depth + 2 for seg in fresh), fresh
    if ahead:
        assert llm.stats.verify_ahead.taken >= 20, llm.stats.verify_ahead
        assert llm.stats.host_phase_s["paused_sync"] > 0  # the deferral's own host phase
        # the full rings' flushes behind the launch: a phase of their own
        assert ("deferred_flush" in llm.stats.host_phase_s) == behind, llm.stats.host_phase_s
    # a flush that would write nothing leaves holes: the check above can fail
    d = llm.engine.runner.deferred
    monkeypatch.setattr(type(d), "_flush", lambda self, *a, **k: self.drop())
    _, holes, _, _ = _run(target, head, smollm2_gguf_path, True, ahead, monkeypatch,
                          paused_flush_depth=depth)
    assert not all(torch.allclose(h, e, rtol=1e-5, atol=1e-5) for h, e in zip(holes, ref_kv))


@pytest.mark.parametrize("defer", [False, True])
def test_sampled_paused_steps_launch_ahead(trained_eagle3_pair, smollm2_gguf_path, defer):
    """Sampled requests in paused steps (one with logprobs): the next decode launches from the
    device's draw, behind the draft's first pass (replayed from that draw, or deferred), as
    greedy ones do from the argmax; the output and logprobs are vanilla sampling's, and no
    launch is skipped for sampling or logprobs."""
    target, head = trained_eagle3_pair
    sps = [SamplingParams(max_tokens=n, temperature=t, seed=5 + i, ignore_eos=True,
                          logprobs=2 if i == 1 else None)
           for i, (n, t) in enumerate(zip((30, 19, 26, 30), (0.8, 1.0, 0.0, 0.7)))]
    want = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128).generate(PROMPTS,
                                                                                      sps)
    llm = with_emulated_graphs(LLM(
        model=target, tokenizer=smollm2_gguf_path, max_model_len=128, draft=head,
        num_speculative_tokens=K, speculation_policy="adaptive", verify_ahead=True,
        max_num_seqs=4, defer_paused_first_pass=defer, paused_flush_depth=DEPTH), k=K)
    llm.engine.stats.policy = ModesInTurn(MODES)
    assert_same_logprobs(llm.generate(PROMPTS, sps), want)  # (one request wants them)
    ahead = llm.stats.verify_ahead
    assert ahead.taken >= 10 and not {"sampling", "logprobs"} & set(ahead.skipped), ahead
    assert (llm.stats.deferred_first_pass is not None) == defer
    assert llm.stats.num_step_faults == 0


def test_deferred_first_pass_eagle1_and_preemption(eagle1_pair, smollm2_gguf_path,
                                                   monkeypatch):
    """EAGLE-1 (one hidden tensor, no fc), uncaptured: the same output and acceptance with
    and without deferral, also where a small KV pool preempts requests in the middle of
    their pauses (their deferred rows are dropped; recompute writes that KV again), and with
    the prefix cache (a block is registered once its draft KV is written)."""
    target, head = eagle1_pair
    want = _vanilla(target, smollm2_gguf_path)
    for kw in ({}, {"num_kv_blocks": 9, "page_size": 8},
               {"enable_prefix_caching": True, "page_size": 4}):
        runs = []
        for defer in (False, True):
            llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, draft=head,
                      num_speculative_tokens=K, speculation_policy="adaptive", max_num_seqs=4,
                      defer_paused_first_pass=defer, paused_flush_depth=DEPTH, **kw)
            llm.engine.stats.policy = ModesInTurn(MODES)
            ids = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
            if "enable_prefix_caching" in kw:  # again: blocks registered only once their
                # draft KV is written (draft_computed) are matched now
                assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == ids
                assert llm.stats.num_cached_tokens > 0
            runs.append((ids, llm))
        (ids_off, off), (ids_on, on) = runs
        assert ids_on == ids_off == want
        assert on.stats.spec.accepted_per_position == off.stats.spec.accepted_per_position
        st = on.stats.deferred_first_pass
        assert st.deferred_steps > 20 and st.flush_reasons.get("full", 0) > 0, st
        if "num_kv_blocks" in kw:
            assert on.stats.num_preemptions > 0
            assert on.engine.allocator.num_free == 9


def test_defer_option_is_checked(eagle1_pair, smollm2_gguf_path):
    target, head = eagle1_pair
    with pytest.raises(ValueError, match="defer_paused_first_pass='yes'"):
        LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
            speculation_policy="adaptive", defer_paused_first_pass="yes")
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"paused_flush_depth={bad!r}"):
            LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
                speculation_policy="adaptive", paused_flush_depth=bad)
    with pytest.raises(ValueError, match="cut_losing_probes=1"):
        LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
            speculation_policy="adaptive", cut_losing_probes=1)
    always = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
                 speculation_policy="always")
    assert always.engine.runner.deferred is None  # nothing pauses
    # the default depth: 32 paused steps per flush, fewer rows for wide engines, never < k + 1
    auto = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
               num_speculative_tokens=K, speculation_policy="adaptive", max_num_seqs=4)
    assert auto.engine.runner.deferred.depth == 32
    # the policy cuts losing probes only when told to (opt-in since the forty-fifth session)
    assert auto.stats.policy.probe_trials is None
    cut = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
              speculation_policy="adaptive", cut_losing_probes=True)
    assert cut.stats.policy.probe_trials == SpecPolicy.probe_trials
    # probes back off by default (forty-sixth session); probe_backoff=False: neither back-off
    assert auto.stats.policy.fresh_backoff is True
    assert auto.stats.policy.probe_cost_ref == SpecPolicy.probe_cost_ref
    flat = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
               speculation_policy="adaptive", probe_backoff=False)
    assert flat.stats.policy.fresh_backoff is False and flat.stats.policy.probe_cost_ref == math.inf
    with pytest.raises(ValueError, match="probe_backoff='no'"):
        LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
            speculation_policy="adaptive", probe_backoff="no")
    # a full ring flushes behind the next launch by default; False: before it
    assert auto.engine.runner.deferred.behind is True
    before = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
                 speculation_policy="adaptive", flush_behind_launch=False)
    assert before.engine.runner.deferred.behind is False
    with pytest.raises(ValueError, match="flush_behind_launch=1"):
        LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
            speculation_policy="adaptive", flush_behind_launch=1)
    assert [flush_depth(None, 5, n) for n in (1, 64, 128, 256, 1024)] == [32, 32, 16, 8, 6]
    assert flush_depth(3, 5, 64) == 3


def test_faults_in_paused_steps_and_flushes_leave_outputs_exact(bigram_eagle3,
                                                               smollm2_gguf_path):
    """A step that raises in the middle of a pause (and a flush that raises) is retried as
    any faulty step: the runner's reset writes or drops the deferred rows, every request
    still gets vanilla's tokens and every block is freed."""
    from compiled_spec.engine.deferred_first_pass import DeferredFirstPass

    target, head = bigram_eagle3
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want = [o.token_ids for o in LLM(model=target, tokenizer=smollm2_gguf_path,
                                     max_model_len=64).generate(prompts, sp)]
    for where in ("execute", "flush"):
        llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
                  num_speculative_tokens=K, speculation_policy="adaptive", page_size=4,
                  paused_flush_depth=DEPTH)
        eng = llm.engine
        eng.stats.policy = ModesInTurn([SPEC] + [PLAIN] * 12)
        d = eng.runner.deferred
        calls = [0]
        if where == "execute":
            orig = eng.runner.execute

            def execute(reqs, *a):
                calls[0] += 1
                if calls[0] == 9:  # deferred rows pending
                    assert d.pending
                    raise RuntimeError("injected")
                return orig(reqs, *a)

            eng.runner.execute = execute
        else:
            orig = DeferredFirstPass._flush

            def flush(self, *a, **k):
                calls[0] += 1
                if calls[0] == 1:
                    raise RuntimeError("flush broke")
                return orig(self, *a, **k)

            d._flush = flush.__get__(d)
        outs = llm.generate(prompts, sp)
        assert [o.token_ids for o in outs] == want, where
        assert llm.stats.num_step_faults >= 1 and calls[0] > 1, where
        a = eng.allocator
        assert a.num_free == a.num_blocks and not a.tables
        assert llm.stats.deferred_first_pass.deferred_steps > 0
