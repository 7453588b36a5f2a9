"""Early tree propose (compiled_spec/engine/early_tree.py) on the CPU through emulated graphs: a
greedy tree step launches its next trees before the host reads the acceptance, from the
acceptance the graph computes itself. Greedy output must equal vanilla decoding and the late
path's, acceptance must equal the late path's, and the early graph must draft the trees and
write the draft KV exactly as the late graphs do."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_flatten

from capture import CapturePolicy
from compiled_spec import LLM, SamplingParams
from compiled_spec.compile import CompileConfig, capture_graphs, compile_models
from compiled_spec.engine.batch import Span
from compiled_spec.engine.stats import counts_since
from compiled_spec.spec.proposer import ProposeBatch
from compiled_spec.spec.tree import accept_paths
from compiled_spec.spec.tree_accept_device import accept_greedy_device, first_pass_rows
from tests.engine_runs import assert_same_logprobs, logprob_params
from tests.engine_runs import generate_in_batches as _gen
from tests.spec_models import give_attention

D, TOPK, N = 3, 2, 6
TREE = dict(num_speculative_tokens=D, speculative_topk=TOPK, speculative_num_draft_tokens=N)
PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 2], [11, 12], [6, 6, 6, 1, 2]]
AFTER_CAPTURE: dict[str, int] = {}  # graphs per compiled callable once capture is done


def _random_trees(rng: np.random.Generator, b: int, n: int, d: int) -> tuple[np.ndarray, ...]:
    """Trees in the runner's layout (a parent's index below its child's, depth <= d), sibling
    tokens distinct but repeated across branches (1, 2, ... per parent), and draws from
    {0..3}: 0 matches no child, so every path length shows up."""
    par = np.full((b, n), -1)
    dep = np.zeros((b, n), dtype=np.int64)
    tok = np.zeros((b, n), dtype=np.int64)
    for r in range(b):
        kids: dict[int, int] = {}
        for j in range(1, n):
            p = int(rng.choice([i for i in range(j) if dep[r, i] < d]))
            par[r, j], dep[r, j] = p, dep[r, p] + 1
            kids[p] = kids.get(p, 0) + 1
            tok[r, j] = kids[p]
    return tok, par, dep, rng.integers(0, 4, (b, n))


@pytest.mark.parametrize("b", [2, 64])  # the host's walk (b <= 2) and its numpy version
def test_device_acceptance_equals_accept_paths(b):
    rng = np.random.default_rng(b)
    tok, par, dep, drawn = _random_trees(rng, b, 12, 4)
    path, n_acc, bonus = accept_paths(tok, par, drawn, dep, 4)
    t = [torch.from_numpy(a).long() for a in (tok, par, dep, drawn)]
    d_path, d_n, d_bonus = accept_greedy_device(*t, 4)
    assert d_n.tolist() == n_acc.tolist() and d_bonus.tolist() == bonus.tolist()
    assert d_path.tolist() == np.where(path >= 0, path, 0).tolist()
    assert len(set(n_acc.tolist())) >= 2  # not all trees alike
    # The first pass's rows: accepted tokens then the bonus, hidden of the root then the path.
    ids, nodes, live = first_pass_rows(t[0], d_path, d_n, d_bonus)
    for r in range(b):
        a = int(n_acc[r])
        assert ids[r, :a + 1].tolist() == tok[r, path[r, :a]].tolist() + [int(bonus[r])]
        assert nodes[r, :a + 1].tolist() == [0] + path[r, :a].tolist()
        assert live[r].tolist() == [j <= a for j in range(5)]
    # Padded rows accept nothing, whatever their stale trees say.
    dead = accept_greedy_device(*t, 4, live=torch.zeros(b, dtype=torch.bool))[1]
    assert dead.tolist() == [0] * b


def test_early_stage_compiled_by_inductor_equals_eager():
    """The early tree step's device staging (spec.tree_accept_device.early_tree_stage) compiled
    by Inductor (as compile=True runs it inside the early graph) equals its eager run, with
    padded rows and requests whose tables end early."""
    from passes import make_backend
    from compiled_spec.spec.tree_accept_device import early_tree_stage

    rng = np.random.default_rng(7)
    b, n, d, q, topk, steps, page, w = 4, 12, 4, 5, 3, 3, 4, 6
    tok, par, dep, drawn = (torch.from_numpy(a).long() for a in _random_trees(rng, b, n, d))
    acc = torch.stack([tok, par, dep, drawn], dim=1)  # [b, 4, N]
    live = torch.tensor([1, 1, 0, 1], dtype=torch.int32)
    start = torch.tensor([5, 17, 0, 9])
    slots = torch.from_numpy(rng.integers(0, 90, b * q))
    row0 = torch.tensor([0, 7, 0, 14])
    tables = torch.from_numpy(rng.permutation(40)[:b * w].reshape(b, w)).int()
    covered = torch.tensor([24, 40, 0, 12])  # request 3's expansion runs past its table
    tslots = torch.from_numpy(rng.integers(0, 90, (b, n)))
    dslots = torch.from_numpy(rng.integers(0, 90, (b, d)))
    args = (acc, live, start, slots, row0, tables, covered, tslots, dslots, d, q, topk, steps,
            page, 2)
    want = early_tree_stage(*args)
    fn = torch.compile(early_tree_stage, backend=make_backend(hoist_fc=False), fullgraph=True)
    got = fn(*args)
    assert len(got) == len(want) == 10
    for g, e in zip(got, want):
        assert torch.equal(g, e)
    assert want[9].shape == (2, b * d) and (want[7] == -1).any() and (want[7] >= 0).any()


def _llm(pair, tok: str, draft: bool) -> LLM:
    target, head = pair
    extra = dict(draft=head, **TREE) if draft else {}
    llm = LLM(model=target, tokenizer=tok, max_model_len=96, max_num_seqs=4, page_size=4,
              num_kv_blocks=128, **extra)
    give_attention(llm)  # so that a wrong KV move or draft row shows in the output
    return llm


@pytest.fixture(scope="module")
def engines(trained_eagle3_pair, smollm2_gguf_path):
    """(tree LLM with emulated graphs, the early tree graph captured; vanilla eager LLM)."""
    spec = _llm(trained_eagle3_pair, smollm2_gguf_path, True)
    models = compile_models(spec.engine.runner, CompileConfig(inductor=False))
    spec._compiled = models
    policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=D, max_model_len=96,
                           batch_sizes=(1, 4), seq_len_buckets=(96,))
    capture_graphs(spec.engine.runner, models, policy, 4, emulate=True)
    AFTER_CAPTURE.update({n: b["graphs"] for n, b in spec.compile_stats.items()
                          if isinstance(b, dict) and "graphs" in b})
    return spec, _llm(trained_eagle3_pair, smollm2_gguf_path, False)


def _stopping(vanilla: LLM, stopper: int, at: int) -> tuple[list[SamplingParams], list]:
    """Greedy params for PROMPTS with different budgets, request ``stopper`` stopping at its
    ``at``-th token (a stop token id); and vanilla's outputs for them."""
    sps = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
           for m in (21, 14, 30, 9, 25)]
    stop = _gen(vanilla, PROMPTS, sps, 1)[stopper][at]
    sps[stopper] = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                  stop_token_ids=[stop])
    return sps, _gen(vanilla, PROMPTS, sps, 1)


def _run(spec: LLM, early: bool, prompts, sps, batch: int) -> tuple[list, int, dict]:
    runner, st = spec.engine.runner, spec.stats
    runner.early.enabled = early
    acc0, before = st.spec.num_accepted_tokens, st.early_propose.as_dict()
    try:
        out = _gen(spec, prompts, sps, batch)
    finally:
        runner.early.enabled = True
    return (out, st.spec.num_accepted_tokens - acc0,
            counts_since(before, st.early_propose.as_dict()))


def _run_ahead(spec: LLM, sps, batch: int) -> tuple[list, int, dict, dict]:
    """``_run`` early with the trees' verify ahead on: its outputs, accepted count and
    early-propose counters, and the verify-ahead counters of the run."""
    ahead = spec.engine.runner.ahead
    before = ahead.stats.as_dict()
    ahead.enabled = True
    try:
        out, acc, early_st = _run(spec, True, PROMPTS, sps, batch)
    finally:
        ahead.enabled = False
    return out, acc, early_st, counts_since(before, ahead.stats.as_dict())


@pytest.mark.parametrize("batch", [1, 3])
def test_early_tree_equals_vanilla_and_late(engines, batch):
    """Requests ending at different steps (max_tokens, a stop token), batches padded (3 -> 4)."""
    spec, vanilla = engines
    sps, ref = _stopping(vanilla, 2, 12)
    late, late_acc, late_st = _run(spec, False, PROMPTS, sps, batch)
    early, early_acc, early_st = _run(spec, True, PROMPTS, sps, batch)
    assert late == ref and early == ref
    assert late_st["early"] == 0 and late_st["late_reasons"].get("off", 0) > 0
    assert early_st["early"] > 0, early_st  # the early path ran: no pass by falling back
    # requests near their budgets (and the one at its stop token) went early too: only the
    # batch's end (a lone one-node request) sends a step late
    assert "near_end" not in early_st["late_reasons"], early_st
    assert late_acc > 0 and early_acc == late_acc  # the device's acceptance is the host's


@pytest.mark.parametrize("batch", [1, 3])
def test_sampled_early_tree_equals_vanilla_and_late(engines, batch):
    """Sampled requests (temperatures, a top-k, one greedy among them) go early: the token at
    each node is vanilla's draw there, so early, late and vanilla sampling agree and accept
    alike, with the next trees' verify launched ahead too."""
    spec, vanilla = engines
    kinds = [dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=0.0),
             dict(temperature=0.7, top_p=0.9), dict(temperature=1.2)]
    sps = [SamplingParams(max_tokens=m, ignore_eos=True, seed=21 + i, **kw)
           for i, (m, kw) in enumerate(zip((18, 11, 22, 9, 15), kinds))]
    ref = _gen(vanilla, PROMPTS, sps, batch)
    draws = spec._compiled.graphs.sample  # the per-node draws replay (engine/sample_graph.py)
    replays = draws.graph_replays
    late, late_acc, late_st = _run(spec, False, PROMPTS, sps, batch)
    early, early_acc, early_st = _run(spec, True, PROMPTS, sps, batch)
    assert late == ref and early == ref
    assert draws.graph_replays > replays and not draws.eager_fallbacks, draws.stats()
    assert early_st["early"] > 0 and "sampling" not in early_st["late_reasons"], early_st
    assert late_acc > 0 and early_acc == late_acc
    # ... and their early steps launch the next trees' verify (verify_ahead_tree.py)
    faults = spec.stats.num_step_faults
    out, acc, _, d = _run_ahead(spec, sps, batch)
    assert out == ref and acc == late_acc
    assert d["taken"] + d["taken_subset"] > 0, d
    assert spec.stats.num_step_faults == faults


def test_tree_logprobs_go_early_and_equal_the_late_path(engines):
    """Requests with logprobs (greedy and sampled, beside one without) go early: every node's
    logprobs are computed on the device before the replay; late, early and early with the
    next trees' verify launched ahead give vanilla's tokens and logprobs."""
    spec, vanilla = engines
    sps = logprob_params(41, (15, 9, 18))
    prompts = PROMPTS[:3]
    want = vanilla.generate(prompts, sps, use_tqdm=False)
    runner, st = spec.engine.runner, spec.stats
    for early, ahead in ((False, False), (True, False), (True, True)):
        runner.early.enabled, runner.ahead.enabled = early, ahead
        before, faults = st.early_propose.as_dict(), st.num_step_faults
        try:
            got = spec.generate(prompts, sps, use_tqdm=False)
        finally:
            runner.early.enabled, runner.ahead.enabled = True, False
        assert_same_logprobs(got, want)
        d = counts_since(before, st.early_propose.as_dict())
        assert (d["early"] > 0 and "logprobs" not in d["late_reasons"]) == early, d
        assert st.num_step_faults == faults


@pytest.mark.parametrize("batch", [1, 3])
def test_tree_verify_ahead_equals_vanilla(engines, batch, monkeypatch):
    """Verify ahead for trees (engine/verify_ahead_tree.py): each early tree step launches the
    next trees' verify from its acceptance. Greedy output must equal vanilla decoding with the
    same acceptance as without it; launches must be taken (no pass by always discarding), and
    requests ending mid-batch (budgets, a stop token) must leave their rows (or, alone, skip the
    launch), counted. Every taken
    verify (whole or the rows of the requests that went on) must equal the verify the step
    would have staged itself: same trees, roots and rows, the same logits."""
    from compiled_spec.engine.tree_verify import stage_and_verify
    spec, vanilla = engines
    # Request 1 stops mid-batch while 0 and 2 go on (rows 0 and 2 of the launch are kept).
    sps, ref = _stopping(vanilla, 1, 10)
    ahead, st = spec.engine.runner.ahead, spec.stats
    plain, plain_acc, _ = _run(spec, True, PROMPTS, sps, batch)
    faults = st.num_step_faults
    take, checked = ahead.take_tree, []

    def take_checked(reqs):
        v = take(reqs)
        if v is not None:  # the oracle: this step's own staging and verify
            want = stage_and_verify(spec.engine.runner, reqs)
            assert (v.starts, v.qsl, v.base) == (want.starts, want.qsl, want.base)
            # Parents, depths and drafted tokens (a graph-fed root column is not read).
            assert torch.equal(v.tree_info[1:], want.tree_info[1:])
            assert torch.equal(v.tree_info[0, :, 1:], want.tree_info[0, :, 1:])
            torch.testing.assert_close(v.logits, want.logits, rtol=1e-4, atol=1e-4)
            checked.append(len(reqs))
        return v
    monkeypatch.setattr(ahead, "take_tree", take_checked)
    # Every launch verifies the early graph's trees where its replay left them (no copies).
    g, held = spec.engine.runner.early.graph, []
    holds_tree = g.holds_tree
    monkeypatch.setattr(g, "holds_tree", lambda t, m: held.append(holds_tree(t, m)) or held[-1])
    out, acc, early_st, d = _run_ahead(spec, sps, batch)
    assert plain == ref and out == ref
    assert acc == plain_acc > 0 and early_st["early"] > 0
    launched, taken, subset = d["launched"], d["taken"], d["taken_subset"]
    discarded = sum(d["discarded"].values())
    assert taken > 0 and launched == taken + subset + discarded, d
    if batch == 1:  # the stop token is seen before the launch: none for that step
        assert d["skipped"].get("stopping", 0) == 1 and discarded == 0, d
    else:  # request 1 stops while 0 and 2 go on: they take their rows of the launch
        assert subset > 0, d
    assert st.verify_ahead is ahead.stats
    # No step recovered from a fault (a recovery would recompute and hide a wrong input).
    assert st.num_step_faults == faults
    assert len(checked) == taken + subset
    assert len(held) >= launched and all(held), held


def test_early_tree_graph_writes_what_the_late_graphs_write(engines):
    """Three requests accepting 0, 2 and all D nodes of random trees (one off the first
    branch): the early graph, given the trees and the argmax, must draft the trees the late
    graphs draft from the host's acceptance, and leave the draft KV and the target KV (the
    accepted nodes moved to their depths' positions) exactly as the late path does. Fails if
    the path, roots, slots or moves are wrong."""
    spec, _ = engines
    runner = spec.engine.runner
    prop, alloc = runner.proposer, runner.allocator
    early = prop.early_graph
    ids, starts = [1000, 1001, 1002], [9, 21, 30]
    for i, s in zip(ids, starts):
        alloc.grow(i, s + D + 2 + runner.tree.lookahead)
    # Chains of depth D along different branches: node j's parent and token.
    par = torch.tensor([[-1, 0, 0, 1, 2, 3]] * 3)  # [3, N]: 0-1-3-5 and 0-2-4
    dep = torch.tensor([[0, 1, 1, 2, 2, 3]] * 3)
    tok = torch.tensor([[0, 5, 6, 7, 8, 9]] * 3)
    drawn = torch.tensor([[1, 7, 8, 9, 2, 3],  # root draws 1: nothing accepted
                          [6, 7, 8, 9, 2, 3],  # 2 then 4: two accepted, off the first branch
                          [5, 7, 8, 9, 2, 3]])  # 1, 3, 5: all D
    path, n_acc, bonus = accept_paths(tok.numpy(), par.numpy(), drawn.numpy(), dep.numpy(), D)
    assert n_acc.tolist() == [0, 2, 3]
    gen = torch.Generator().manual_seed(0)
    th = spec.engine.model.config.hidden_size
    aux = [torch.randn(3 * N, th, generator=gen) for _ in runner.aux_layer_ids]
    ms = [int(a) + 1 for a in n_acc]
    batch = ProposeBatch(
        first_pass=[Span(i, s, m) for i, s, m in zip(ids, starts, ms)],
        token_ids=[t for b in range(3) for t in
                   tok[b, path[b, :n_acc[b]]].tolist() + [int(bonus[b])]],
        hidden_rows=[b * N + j for b in range(3) for j in [0] + path[b, :n_acc[b]].tolist()],
        step_limits=[0] * 3, temperature=[0.0] * 3, seeds=[1, 2, 3])
    target_kv = [c for kv in runner._caches() for c in kv]
    # Distinct target KV at the requests' positions: a fresh pool may hold equal values there
    # (this test alone), and then a move changes nothing the checks below could see
    rows = [alloc.slot(i, p) for i, s in zip(ids, starts) for p in range(s, s + D + 2)]
    with torch.inference_mode():
        for c in target_kv:
            flat = c.flatten(0, 1)  # [blocks * page, ...]
            flat[rows] = torch.randn(len(rows), *flat.shape[1:], generator=gen).to(flat.dtype)
    caches = [t for t in tree_flatten(spec.engine.kv_caches)[0] if isinstance(t, torch.Tensor)]
    caches += [c for c in target_kv if all(c is not t for t in caches)]
    before = [t.clone() for t in caches]
    # The late path's target-KV moves (TreeModelRunner._execute_tree's rule, made on the host).
    src = [alloc.slot(i, s + int(path[b, j])) for b, (i, s) in enumerate(zip(ids, starts))
           for j in range(n_acc[b]) if path[b, j] != j + 1]
    dst = [alloc.slot(i, s + j + 1) for b, (i, s) in enumerate(zip(ids, starts))
           for j in range(n_acc[b]) if path[b, j] != j + 1]
    assert len(src) == 4  # request 1's nodes 2 and 4, request 2's nodes 3 and 5
    try:
        want = [t.clone() for t in prop.propose(batch, aux)[0].__dict__.values()]
        runner._compact(runner._caches(), src, dst)
        want_kv = [t.clone() for t in caches]
        for t, b in zip(caches, before):
            t.copy_(b)
        assert early.stage(4, ids, starts) is None
        with torch.inference_mode():  # the graphs' buffers are inference tensors
            early.acc[:3] = torch.stack([tok, par, dep, drawn], dim=1)
        got = early.replay(4, 3, aux)
    finally:
        for i in ids:
            alloc.free(i)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert any(not torch.equal(w, b) for w, b in zip(want_kv, before))  # it wrote draft KV
    moved = [k for k, t in enumerate(caches) if any(t is c for c in target_kv)]
    assert moved and any(not torch.equal(want_kv[k], before[k]) for k in moved)  # and moved
    for t, w in zip(caches, want_kv):
        torch.testing.assert_close(t, w, atol=1e-5, rtol=0)


def test_early_tree_graph_body_is_capturable(engines):
    """What the early graph captures (the device acceptance, the first pass's layout, the
    expansion's metadata, the late graphs' bodies) holds no op a CUDA graph capture refuses: a
    tensor from host data, a device-to-host read, nonzero (tests/test_capturable.py's
    recorder). Run eagerly (Dynamo refuses the recorder's mode), two live requests of four."""
    from compiled_spec.compile import use_compiled
    from tests.test_capturable import _Record

    spec, _ = engines
    runner = spec.engine.runner
    g, alloc = runner.proposer.early_graph, runner.allocator
    for i in (7, 8):
        alloc.grow(i, 40)
    tok, par, dep, drawn = (torch.from_numpy(a).long() for a in
                            _random_trees(np.random.default_rng(0), 2, N, D))
    rec = _Record()
    use_compiled(runner, spec._compiled, False)
    try:
        assert g.stage(4, [7, 8], [5, 9]) is None
        with torch.inference_mode():
            g.acc[:2] = torch.stack([tok, par, dep, drawn], dim=1)
            with rec:
                out = g._body(4)
    finally:
        use_compiled(runner, spec._compiled, True)
        for i in (7, 8):
            alloc.free(i)
    assert rec.bad == [], sorted(set(rec.bad))
    assert out[0].shape == (4, N)


def test_early_and_late_tree_graphs_share_the_draft_compiles(engines):
    """The early graph runs the late graphs' bodies on their own static buffers, so the draft
    callables see the tensors they were compiled for (buffers of its own, inference tensors
    at other offsets, made Dynamo compile every draft callable again). Every callable, the
    tree glue included: one compile for batch 1 and batch 4 (size-oblivious symbols). The
    expansion and the node selection used to compile per batch class, 1 and 4: one row's
    top-k kept the sort's row stride and their inputs' stride guards failed at 4; the early
    stage's table lookup reshaped a permute, a view only at b == 1 (seconds of a start-up on
    the H200)."""
    engines  # noqa: B018  (the fixture captures and records the counts)
    want = {"draft_step": 1, "tree_head": 1, "tree_step": 1, "tree_finish": 1,
            "tree_early_stage": 1}
    assert {n: AFTER_CAPTURE[n] for n in want} == want, AFTER_CAPTURE
