"""Early propose (compiled_spec/engine/early_propose.py) on the CPU through emulated graphs: a
chain step launches its proposal before the host reads the acceptance, from the acceptance the
graph computes itself. Greedy output must equal vanilla decoding and the late path's, acceptance
must equal the late path's (a wrong device-side n_acc only costs acceptance, never output), and
the graph must write exactly the draft KV the late graph writes (masked rows write nothing)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten

from capture import CapturePolicy
from compiled_spec import LLM, SamplingParams
from compiled_spec.compile import CompileConfig, capture_graphs, compile_models
from compiled_spec.engine.batch import Span
from compiled_spec.engine.stats import counts_since
from compiled_spec.spec.proposer import ProposeBatch
from tests.engine_runs import assert_same_logprobs, logprob_params
from tests.engine_runs import generate_in_batches as _gen

K = 3
PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 2], [11, 12], [6, 6, 6, 1, 2]]
AFTER_CAPTURE: dict[str, int] = {}  # graphs per compiled callable once capture is done


@pytest.fixture(scope="module")
def engines(trained_eagle3_pair, smollm2_gguf_path):
    """(speculative LLM with emulated graphs, early propose captured; vanilla eager LLM). Pages
    of 4 tokens: proposals cross block boundaries often."""
    target, head = trained_eagle3_pair
    kw = dict(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, max_num_seqs=4,
              page_size=4, num_kv_blocks=96)
    spec = LLM(draft=head, num_speculative_tokens=K, **kw)
    models = compile_models(spec.engine.runner, CompileConfig(inductor=False))
    spec._compiled = models
    policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=K, max_model_len=128,
                           batch_sizes=(1, 2, 4), seq_len_buckets=(128,))
    capture_graphs(spec.engine.runner, models, policy, 4, emulate=True)
    AFTER_CAPTURE.update({n: b["graphs"] for n, b in spec.compile_stats.items()
                          if isinstance(b, dict) and "graphs" in b})
    return spec, LLM(**kw)


def _run(spec: LLM, early: bool, prompts, sps, batch: int) -> tuple[list[list[int]], int, dict]:
    """(outputs, accepted drafts, early-propose counters) of one run, the switch set."""
    runner, st = spec.engine.runner, spec.stats
    runner.early.enabled = early
    acc0, before = st.spec.num_accepted_tokens, st.early_propose.as_dict()
    out = _gen(spec, prompts, sps, batch)
    diff = counts_since(before, st.early_propose.as_dict())
    runner.early.enabled = True
    return out, st.spec.num_accepted_tokens - acc0, diff


@pytest.mark.parametrize("batch", [1, 3])
def test_early_propose_equals_vanilla_and_late(engines, batch, monkeypatch):
    """Mixed prompt lengths, requests ending at different steps (max_tokens, a stop token),
    each verifying its full k up to its end (what passes its budget is dropped). Steps after
    an early step verify the drafts where its replay left them (in acc: no copy)."""
    spec, vanilla = engines
    g, held = spec.engine.runner.early.graph, []
    holds_drafts = g.holds_drafts
    monkeypatch.setattr(g, "holds_drafts", lambda d: held.append(holds_drafts(d)) or held[-1])
    prompts = PROMPTS + PROMPTS[:1]
    free = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
            for m in (7, 11, 16, 9, 20, 13)]
    ref = _gen(vanilla, prompts, free, 1)
    stop_tok = ref[5][6]  # the last request stops at its first `stop_tok`
    sps = free[:5] + [SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True,
                                     stop_token_ids=[stop_tok])]
    ref = _gen(vanilla, prompts, sps, 1)
    assert len(ref[5]) <= 7 and ref[5][-1] == stop_tok
    late, late_acc, late_st = _run(spec, False, prompts, sps, batch)
    early, early_acc, early_st = _run(spec, True, prompts, sps, batch)
    assert late == ref and early == ref
    assert late_st["early"] == 0 and late_st["late_reasons"].get("off", 0) > 0
    assert early_st["early"] > 0, early_st  # the early path ran: no pass by falling back
    # Only the steps carrying a prompt run late: near its budget a request still verifies its
    # full k (kv_limit), so the step keeps the early path's shape. One prompt step per request
    # at batch 1; at batch 3 a prompt step may carry several.
    not_chain = early_st["late_reasons"].get("not_chain", 0)
    assert not_chain == len(prompts) if batch == 1 else 0 < not_chain <= len(prompts), early_st
    assert late_acc > 0 and early_acc == late_acc  # the device-side acceptance is the host's
    assert any(held), held  # early steps in a row took the drafts in place


def _sampled(budgets: list[int]) -> list[SamplingParams]:
    """Sampled params (temperatures, a top-k, a top-p, one greedy request among them), a seed
    each: vanilla's output for them is fixed, and speculation must give the same tokens."""
    kinds = [dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=0.0),
             dict(temperature=0.7, top_p=0.9), dict(temperature=1.2)]
    return [SamplingParams(max_tokens=m, ignore_eos=True, seed=11 + i, **kinds[i % len(kinds)])
            for i, m in enumerate(budgets)]


@pytest.mark.parametrize("batch", [1, 3])
def test_sampled_early_equals_vanilla_and_late(engines, batch):
    """Sampled requests go early (argmax drafts): the acceptance input is vanilla's draw at
    each slot, so early, late and vanilla sampling give the same tokens, and early steps
    accept what late ones do (the graph's acceptance is the host's)."""
    spec, vanilla = engines
    sps = _sampled([14, 9, 18, 12, 16])
    ref = _gen(vanilla, PROMPTS, sps, batch)
    late, late_acc, late_st = _run(spec, False, PROMPTS, sps, batch)
    early, early_acc, early_st = _run(spec, True, PROMPTS, sps, batch)
    assert late == ref and early == ref
    assert early_st["early"] > 0, early_st
    assert set(early_st["late_reasons"]) <= {"not_chain"}, early_st  # prompt steps only
    assert late_acc > 0 and early_acc == late_acc


def test_logprobs_go_early_and_equal_the_late_path(engines):
    """Requests with logprobs (greedy and sampled, beside one without) go early: their
    logprobs are computed on the device before the replay, and equal the late path's and
    vanilla's."""
    spec, vanilla = engines
    sps = logprob_params(31, (14, 11, 16))
    prompts = PROMPTS[:3]
    want = vanilla.generate(prompts, sps, use_tqdm=False)
    runner, st = spec.engine.runner, spec.stats
    outs = {}
    for early in (False, True):
        runner.early.enabled = early
        before = st.early_propose.as_dict()
        try:
            outs[early] = spec.generate(prompts, sps, use_tqdm=False)
        finally:
            runner.early.enabled = True
        outs[early, "st"] = counts_since(before, st.early_propose.as_dict())
    assert_same_logprobs(outs[False], want)
    assert_same_logprobs(outs[True], want)
    early_st = outs[True, "st"]
    assert early_st["early"] > 0 and "logprobs" not in early_st["late_reasons"], early_st
    assert outs[True][0].outputs[0].logprobs is not None


def test_sampled_drafts_run_late_and_say_so(engines, monkeypatch):
    """With sampled drafts (draft_sampling="sample") Leviathan's rule needs the draft's
    probabilities, which the early graph does not take: a sampled request's step runs late,
    counted; a greedy one's does not."""
    spec, _ = engines
    early = spec.engine.runner.early
    monkeypatch.setattr(spec.engine.runner.proposer, "sample_drafts", True)
    reqs = [type("Q", (), {"params": sp})() for sp in _sampled([4, 4])]
    assert early._size(reqs, None) == "sampled_drafts"
    greedy = [type("Q", (), {"params": SamplingParams(max_tokens=4, temperature=0.0)})()]
    assert early._size(greedy, None) == early.graph.graph_size(1)


def test_kv_nearly_exhausted_falls_back_and_says_so(engines):
    """With few free blocks the worst-case growth (all k accepted) fails: the step proposes late,
    counted under kv_exhausted, and output does not change."""
    spec, vanilla = engines
    alloc = spec.engine.allocator
    sps = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    prompts = [PROMPTS[0], PROMPTS[2]]
    ref = _gen(vanilla, prompts, sps, 2)
    # The two need 27 and 31 positions (7 + 8 blocks of 4) in all: with 14 free the one ahead
    # cannot reserve k + 1 positions more than the scheduler does (the other then waits).
    reserve = -1
    alloc.grow(reserve, (alloc.num_free - 14) * alloc.page_size)
    try:
        out, _, st = _run(spec, True, prompts, sps, 2)
    finally:
        alloc.free(reserve)
    assert out == ref
    assert st["late_reasons"].get("kv_exhausted", 0) > 0, st
    assert st["early"] > 0, st


def test_early_graph_writes_what_the_late_graph_writes(engines):
    """Three requests that accept 0, 2 and all 3 drafts, the second near its budget (k_next
    = 1: loop steps past its limit write nothing): the early graph, given only the argmax and
    the verified drafts, must draft what the late graph drafts from the host's acceptance and
    leave the draft KV exactly as the late graph leaves it. Fails if rows past the accepted
    ones write KV (the request accepting 0 leaves row k unwritten by the loop), if n_acc or
    the limits are computed wrongly."""
    spec, _ = engines
    runner = spec.engine.runner
    prop, alloc, q = runner.proposer, runner.allocator, K + 1
    late, early = prop.graph, prop.early_graph
    starts, n_acc, max_total = [9, 21, 30], [0, 2, 3], [40, 27, 60]
    ids = [1000, 1001, 1002]
    for i, s, mt in zip(ids, starts, max_total):
        alloc.grow(i, min(s + 1 + 2 * K + 1, mt))
    gen = torch.Generator().manual_seed(0)
    vocab = spec.engine.model.config.vocab_size
    target = torch.randint(0, vocab, (3, q), generator=gen)  # [3, k+1] the target's argmax
    drafts = target[:, :K].clone()  # [3, k] the drafts the step verified
    for b, a in enumerate(n_acc):
        if a < K:
            drafts[b, a] = (target[b, a] + 1) % vocab  # the first rejected draft
    th = spec.engine.model.config.hidden_size
    aux = [torch.randn(3 * q, th, generator=gen) for _ in runner.aux_layer_ids]
    ms = [a + 1 for a in n_acc]
    limits = [s + 1 + m - 2 + min(K, mt - (s + 1 + m) - 1)
              for s, m, mt in zip(starts, ms, max_total)]
    batch = ProposeBatch(
        first_pass=[Span(i, s, m) for i, s, m in zip(ids, starts, ms)],
        token_ids=[t for b, m in enumerate(ms) for t in target[b, :m].tolist()],
        hidden_rows=[b * q + j for b, m in enumerate(ms) for j in range(m)],
        step_limits=limits, temperature=[0.0] * 3, seeds=[1, 2, 3])
    caches = [t for t in tree_flatten(spec.engine.kv_caches)[0] if isinstance(t, torch.Tensor)]
    before = [t.clone() for t in caches]
    try:
        want, _ = late.run(batch, aux)
        want_kv = [t.clone() for t in caches]
        for t, b in zip(caches, before):
            t.copy_(b)
        assert early.stage(4, list(ids), list(starts), [0, q, 2 * q],
                           [0, 1, 2], max_total, [1, 2, 3], [0.0] * 3) is None
        with torch.inference_mode():  # as the engine writes it (the graphs' buffers are
            early.acc[:3] = torch.cat([target, drafts], dim=1)  # inference tensors)
        got, _ = early.replay(4, 3, aux)
    finally:
        for i in ids:
            alloc.free(i)
    assert torch.equal(got, want)
    assert any(not torch.equal(w, b) for w, b in zip(want_kv, before))  # it wrote draft KV
    for t, w in zip(caches, want_kv):
        torch.testing.assert_close(t, w, atol=1e-5, rtol=0)


def test_early_and_late_graphs_share_the_draft_compiles(engines):
    """The early graph computes the loop's metadata on the device and the late graph stages it
    into views of its buffers: both must hand the draft callables tensors Dynamo's guards
    accept alike (dispatch keys: inference tensors; storage offsets >= 2), or every draft
    callable compiles twice (the tenth session found 2 + 2 compiles where 1 + 1 do). Batch 1
    shares the graph of batches 2 and 4 (size-oblivious symbols): 1 each."""
    engines  # noqa: B018  (the fixture captures and records the counts)
    counts = AFTER_CAPTURE
    assert counts["draft_step"] == 1 and counts["draft_step_pick"] == 1, counts


def test_pick_and_plan_compiled_by_inductor_equals_eager(engines):
    """An early step's pick + loop metadata (DraftPick.pick_and_plan) compiled by Inductor,
    as compile=True runs it inside the early graph, equals its eager run: padded rows, a
    request at its budget (every loop position inert) and one whose table ends early."""
    from passes import make_backend

    prop = engines[0].engine.runner.proposer
    g = torch.Generator().manual_seed(3)
    b, q, h = 3, prop.k + 1, prop.draft.config.hidden_size
    with torch.inference_mode():
        for_logits = torch.randn(b * q, h, generator=g)
        feed = torch.randn(b * q, h, generator=g)
        positions = torch.arange(b * q) + 4
        last = torch.tensor([0, q + 2, 2 * q])
        temp, seeds = torch.zeros(b), torch.arange(b)
        start, live = torch.tensor([4, 20, 0]), torch.tensor([1, 1, 0], dtype=torch.int32)
        m = torch.tensor([1, 3, 1])
        max_total = torch.tensor([40, 24, 0])
        tables = torch.randperm(30, generator=g)[:b * 4].view(b, 4).int()
        args = (for_logits, positions, last, feed, temp, seeds, start, live, m, max_total,
                tables, 4, 4)
        want = prop.picker.pick_and_plan(*args)
        fn = torch.compile(prop.picker.pick_and_plan, backend=make_backend(hoist_fc=False),
                           fullgraph=True)
        got = fn(*args)
    assert len(got) == len(want) == 6 and got[1] is None and want[1] is None
    for a, e in zip(got, want):
        if e is not None:
            assert torch.equal(a, e)
    slots = want[4]
    assert (slots[:, 2] == -1).all() and (slots[:, 0] >= 0).any() and (slots[:, 1] == -1).any()
