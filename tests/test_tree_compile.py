"""Draft trees under compile=True: the tree verify forward (target with ``paged_tree_attention``)
and the tree proposer's draft forwards run through our torch.compile backend (Inductor's C++
code on the CPU), and on emulated CUDA graphs (``capture.emulate``) through the tree-verify,
tree first-pass and tree-expand graphs. Compiling must change neither the greedy output (that
of vanilla decoding) nor the acceptance, at any page size; seeded sampling too."""
from __future__ import annotations

from itertools import accumulate

import pytest
import torch

from capture import CapturePolicy
from compiled_spec import LLM, SamplingParams
from compiled_spec.compile import CompileConfig, capture_graphs, compile_models, use_compiled
from compiled_spec.engine.graphs import EngineGraphs
from tests.spec_models import give_attention
from passes.graph_utils import is_op

PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 2], [11, 12], [6, 6, 6, 1, 2, 30, 8, 8, 8, 1]]
SP = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
TREE = dict(num_speculative_tokens=3, speculative_topk=2, speculative_num_draft_tokens=6)
TREE_OP = torch.ops.compiled_spec.paged_tree_attention
TREE_GRAPHS = ("target_tree_verify", "tree_draft_first_pass", "tree_draft_expand")


def _llm(pair, tok: str, page: int = 16, draft: bool = True, attention: bool = False,
         **kw) -> LLM:
    target, head = pair
    extra = dict(draft=head, **TREE) if draft else {}
    llm = LLM(model=target, tokenizer=tok, max_model_len=128, max_num_seqs=4, page_size=page,
              **extra, **kw)
    if attention:  # so that a wrong tree mask or padded row in the verify shows in the output
        give_attention(llm)
    return llm


def _ids(llm: LLM, sp: SamplingParams | list[SamplingParams] = SP) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, sp)]


def _tree_graphs_compiled(llm: LLM, name: str) -> int:
    """Graphs of backend ``name`` that hold tree attention (compiled tree forwards)."""
    return sum(any(is_op(n, TREE_OP) for n in g.gm.graph.nodes)
               for g in llm._compiled.backends[name].compiled)


def _calls(graph: torch.fx.Graph, name: str) -> int:
    """Nodes of a Dynamo graph calling ``name`` (a tensor method, a torch function or an aten
    op of that name)."""
    return sum(n.op in ("call_method", "call_function")
               and (n.target == name or getattr(n.target, "__name__", "") == name
                    or is_op(n, getattr(torch.ops.aten, name))) for n in graph.nodes)


def _softmaxes(graph: torch.fx.Graph) -> int:
    return sum(_calls(graph, n) for n in ("log_softmax", "_log_softmax", "softmax", "_softmax"))


def _assert_expansions_compiled_whole(llm: LLM) -> None:
    """Layer 1's top-k, every expansion (the draft layer with tree attention, its two top-k
    and the next frontier's gathers) and the node selection ran as compiled graphs: the glue
    around the draft layer is inside a graph, not eager ATen ops between graphs."""
    b = llm._compiled.backends
    steps = [g.gm.graph for g in b["tree_step"].compiled]
    topk, topk_lp = torch.ops.compiled_spec.row_topk, torch.ops.compiled_spec.row_topk_logprob
    # The children's top-k takes the logits (its log-probabilities in its own launch), the
    # next frontier's the scores: no log_softmax left in the graph.
    assert any(any(is_op(n, TREE_OP) for n in g.nodes) and sum(is_op(n, topk) for n in g.nodes)
               == 1 and sum(is_op(n, topk_lp) for n in g.nodes) == 1
               and _softmaxes(g) == 0 and _calls(g, "gather") == 4
               for g in steps), [str(g) for g in steps]
    assert any(sum(is_op(n, topk_lp) for n in g.gm.graph.nodes) == 1
               and _softmaxes(g.gm.graph) == 0 for g in b["tree_head"].compiled)
    # The selection: ranks by pairwise comparisons of the packed keys (three sums), no
    # library top-k or sort (spec.tree.select_nodes).
    finish = [g.gm.graph for g in b["tree_finish"].compiled]
    assert any(_calls(g, "sum") == 3 and _calls(g, "topk") == 0 and _calls(g, "argsort") == 0
               for g in finish), [str(g) for g in finish]


@pytest.fixture(scope="module")
def vanilla(trained_eagle3_pair, smollm2_gguf_path):
    return _ids(_llm(trained_eagle3_pair, smollm2_gguf_path, draft=False))


@pytest.fixture(scope="module")
def vanilla_attn(trained_eagle3_pair, smollm2_gguf_path, vanilla):
    out = _ids(_llm(trained_eagle3_pair, smollm2_gguf_path, draft=False, attention=True))
    assert out != vanilla  # attention now changes what the target writes
    return out


def _graphs(llm: LLM, batch_sizes=(1, 2, 4), buckets=(32, 128)) -> EngineGraphs:
    """Compile (our passes, no Inductor: fast) and capture emulated graphs."""
    models = compile_models(llm.engine.runner, CompileConfig(inductor=False))
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=3, max_model_len=128,
                           batch_sizes=batch_sizes, seq_len_buckets=buckets)
    return capture_graphs(llm.engine.runner, models, policy, llm.config.cache.page_size,
                          emulate=True)


@pytest.mark.parametrize("page", [1, 16])
def test_emulated_tree_graphs_equal_eager(trained_eagle3_pair, smollm2_gguf_path, vanilla_attn,
                                          page):
    llm = _llm(trained_eagle3_pair, smollm2_gguf_path, page, attention=True)
    eager = _ids(llm)
    assert eager == vanilla_attn
    assert llm.stats.spec.num_accepted_tokens > 0
    eager_spec = llm.stats.spec.as_dict()
    graphs = _graphs(llm)
    # Greedy tree steps draft early (tests/test_early_tree.py); steps near a request's end late.
    assert set(graphs.registry.runners) == {"target_decode", *TREE_GRAPHS, "tree_draft_early",
                                             "sample_draw"}
    llm.engine.stats.spec = type(llm.stats.spec)()  # count the graphed run alone
    model = llm.engine.runner.model
    readouts: list[int] = []  # eager readouts: the tree-verify graph computes its own logits
    readout = model.compute_logits
    model.compute_logits = lambda h: readouts.append(h.shape[0]) or readout(h)
    prompt_steps0 = llm.stats.num_prefill_steps
    try:
        assert _ids(llm) == eager
    finally:
        del model.compute_logits
    assert 0 < len(readouts) <= llm.stats.num_prefill_steps - prompt_steps0
    assert llm.stats.spec.as_dict() == eager_spec  # same drafts accepted at every position
    st = graphs.stats()
    for name in (*TREE_GRAPHS, "tree_draft_early"):
        assert st["components"][name]["graph_replays"] > 0, (name, st["components"][name])
    assert st["padded_rows"] > 0  # batches of 3 pad to 4
    # Prompt steps have no graph here (no prefill sizes), and are counted as such; the first
    # pass after them replays its graph over the prompt's last positions (its head eager).
    assert st["components"]["target_decode"]["prefill_calls"] > 0
    assert "tree_draft_first_pass" not in st["without_graph"]
    assert "target_tree_verify" not in st["without_graph"]
    assert "tree_draft_expand" not in st["without_graph"]
    use_compiled(llm.engine.runner, llm._compiled, False)  # back to eager: no replays
    replays = graphs.stats()["replayed"]
    assert _ids(llm) == eager and graphs.stats()["replayed"] == replays


def test_uncaptured_tree_batch_sizes_are_counted(trained_eagle3_pair, smollm2_gguf_path,
                                                vanilla):
    llm = _llm(trained_eagle3_pair, smollm2_gguf_path)
    graphs = _graphs(llm, batch_sizes=(1, 2))  # batches of 3-4 have no graph
    assert _ids(llm) == vanilla
    missed = graphs.stats()["without_graph"]
    for name in TREE_GRAPHS:
        assert missed[name].get("size", 0) > 0, (name, missed)


@pytest.mark.parametrize("page", [1, 16])
def test_compiled_tree_equals_eager_and_vanilla(trained_eagle3_pair, smollm2_gguf_path, vanilla,
                                                page):
    llm = _llm(trained_eagle3_pair, smollm2_gguf_path, page, compile=True)  # Inductor
    assert llm.compiled_active
    rep = llm.check_parity(PROMPTS, SP, tau_tolerance=0.0)  # eager run, then compiled run
    print(f"page {page}:\n{rep}")
    assert rep.ok, str(rep)
    assert rep.eager.token_ids == rep.compiled.token_ids == vanilla
    assert rep.compiled.tau == rep.eager.tau and rep.eager.tau >= 2.0
    assert rep.compiled.per_position == rep.eager.per_position
    # The tree forwards really ran compiled: the target's verify and the draft's expansions,
    # each expansion one graph with its glue (tree attention and the top-k together).
    assert _tree_graphs_compiled(llm, "target") >= 1
    _assert_expansions_compiled_whole(llm)
    assert llm.compile_stats["cuda_graphs"] == {"off": "device cpu has no CUDA graphs"}


def test_compiled_tree_seeded_sampling_equals_eager(trained_eagle3_pair, smollm2_gguf_path):
    params = [SamplingParams(max_tokens=24, temperature=t, top_p=tp, seed=s, ignore_eos=True)
              for t, tp, s in ((0.8, 1.0, 1), (0.0, 1.0, 0), (1.2, 0.9, 5), (0.5, 1.0, 9),
                               (1.0, 1.0, 3))]
    ref = _ids(_llm(trained_eagle3_pair, smollm2_gguf_path, draft=False), params)
    llm = _llm(trained_eagle3_pair, smollm2_gguf_path, compile=True,
               compile_config=CompileConfig(inductor=False))
    eager_llm = _llm(trained_eagle3_pair, smollm2_gguf_path)
    assert _ids(eager_llm, params) == ref
    assert _ids(llm, params) == ref
    assert llm.stats.spec.num_drafting_steps > 0
    assert llm.stats.spec.as_dict() == eager_llm.stats.spec.as_dict()
    _assert_expansions_compiled_whole(llm)


def test_bench_times_the_staged_tree_verify(trained_eagle3_pair, smollm2_gguf_path):
    """With graphs the tree runner stages its verify from host lists (``run_tree_host``); the
    bench's timer wraps that path too, so a tree row reports its verify time and the engine
    still replays its tree-verify graph under the bench."""
    from compiled_spec.bench.ours import Variant, time_engine

    llm = _llm(trained_eagle3_pair, smollm2_gguf_path, attention=True)
    graphs = _graphs(llm)
    before = graphs.stats()["components"]["target_tree_verify"]["graph_replays"]
    verify = graphs.registry.runners["target_tree_verify"]
    verify.run = None  # the device-tensor path must not be taken: only run_host replays
    rows, _ = time_engine(llm, Variant("tree", "head", True, (2, 6)), PROMPTS[:2], [1], 12, 0.0)
    assert rows[0].verify_ms is not None and rows[0].verify_ms > 0
    assert graphs.stats()["components"]["target_tree_verify"]["graph_replays"] > before


def test_first_pass_graph_gathers_the_accepted_rows(trained_eagle3_pair, smollm2_gguf_path,
                                                    monkeypatch):
    """The first-pass graph gathers each request's accepted target rows itself (staged
    ``rows``, engine.tree_graphs). Those rows skip the tree's unaccepted nodes, so a graph that
    read any other rows would draft other trees: every tree of the graphed run must equal the
    eager run's, and some step must have accepted a node off the first branch."""
    llm = _llm(trained_eagle3_pair, smollm2_gguf_path, attention=True)
    prop = llm.engine.runner.proposer
    real = prop.propose
    seen: list[tuple[list[list[int]], torch.Tensor, torch.Tensor]] = []

    def spy(batch, target_hidden):
        tree, q = real(batch, target_hidden)
        ends = list(accumulate(s.length for s in batch.first_pass))
        rows = [batch.hidden_rows[e - s.length:e] for s, e in zip(batch.first_pass, ends)]
        # Copied now: the trees are graph outputs, valid until the next replay.
        seen.append((rows, tree.tokens.clone(), tree.parents.clone()))
        return tree, q

    monkeypatch.setattr(prop, "propose", spy)
    llm.engine.runner.early.enabled = False  # every proposal through the late graphs
    # ... with a prompt's whole first pass in the proposal: heads written before it leave the
    # proposal the prompt's last rows, renumbered (engine/prompt_head.py; tested with trees in
    # tests/test_draft_prefill_graph.py)
    llm.engine.runner.prompt_head.enabled = False
    eager = _ids(llm)
    eager_seen, seen[:] = list(seen), []
    graphs = _graphs(llm)
    assert _ids(llm) == eager
    for (rows, tok, par), (rows_e, tok_e, par_e) in zip(seen, eager_seen):  # first one off
        assert rows == rows_e
        assert torch.equal(tok, tok_e) and torch.equal(par, par_e), rows
    assert len(seen) == len(eager_seen)
    # A request whose first-pass rows are not one contiguous run: an accepted node that was not
    # its parent's first child in the verify's row order.
    assert any(r[i + 1] - r[i] > 1 for rows, _, _ in seen for r in rows
               for i in range(len(r) - 1))
    st = graphs.stats()
    assert st["components"]["tree_draft_first_pass"]["graph_replays"] > 0
    assert set(st["without_graph"].get("tree_draft_first_pass", {})) <= {"query_len"}


def test_tree_glue_graphs_compile_without_coalesce_tiling(trained_eagle3_pair, smollm2_gguf_path):
    """The tree's glue graphs (and only they) carry TREE_GLUE_INDUCTOR: Inductor's coalesce-tiling
    analysis, which asserts on symbolic sizes, is off there (compiled_spec/compile.py)."""
    import torch._inductor.config as inductor

    from compiled_spec.compile import TREE_GLUE_INDUCTOR

    llm = _llm(trained_eagle3_pair, smollm2_gguf_path)
    models = compile_models(llm.engine.runner, CompileConfig(pdl=False))
    glue = {"tree_head", "tree_step", "tree_finish", "tree_early_stage"}
    assert glue <= set(models.backends)
    if hasattr(inductor.triton, "coalesce_tiling_analysis"):
        assert TREE_GLUE_INDUCTOR == {"triton.coalesce_tiling_analysis": False}
    for name, backend in models.backends.items():
        assert backend.inductor_config == (TREE_GLUE_INDUCTOR if name in glue else {}), name


def test_tree_glue_failing_to_compile_at_batch_above_one(trained_eagle3_pair, smollm2_gguf_path,
                                                         vanilla, monkeypatch):
    """The H200's failure mode (sixteenth session), injected: the tree's node selection
    (``tree_finish``) fails to compile wherever the batch is above 1. Each failing shape is
    compiled once: its capture is retried with that graph's eager callable
    (``capture.errors.capture_retrying``), recorded and counted, so every size keeps a graph,
    no step faults and the output stays vanilla's."""
    from passes.pipeline import CompiledSpecBackend

    llm = _llm(trained_eagle3_pair, smollm2_gguf_path)
    models = compile_models(llm.engine.runner, CompileConfig(inductor=False))
    llm._compiled = models
    target, original = models.backends["tree_finish"], CompiledSpecBackend.__call__
    failing_shapes = []

    def failing(self, gm, example_inputs):
        if self is target:
            shapes = tuple(tuple(x.shape) for x in example_inputs if isinstance(x, torch.Tensor))
            if any(len(sh) == 2 and sh[0] != 1 for sh in shapes):
                failing_shapes.append(shapes)
                assert False  # an empty assertion, as Inductor's
        return original(self, gm, example_inputs)

    monkeypatch.setattr(CompiledSpecBackend, "__call__", failing)
    policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=3, max_model_len=128,
                           batch_sizes=(1, 2, 4), seq_len_buckets=(32, 128))
    with pytest.warns(RuntimeWarning, match="captured with the eager callables instead"):
        graphs = capture_graphs(llm.engine.runner, models, policy, llm.config.cache.page_size,
                                emulate=True)
    st = graphs.stats()["components"]["tree_draft_expand"]
    assert st["captured_sizes"] == [2, 4, 8]  # topk 2: batch 1, 2 and 4, every one
    went_past = st["capture_failures"]
    assert sorted(f["size"] for f in went_past) == [4, 8], went_past  # batch 2 and 4, once
    assert all("AssertionError" in f["error"] and f["captured"] for f in went_past)
    faults = llm.stats.num_step_faults
    assert _ids(llm) == vanilla
    assert llm.stats.num_step_faults == faults  # every step had its graph
    failed = llm.compile_stats["compile_failures"]["tree_finish"]
    assert failed["failed_shapes"] == 2 and failed["eager_calls"] > 0, failed
    assert len(failing_shapes) == len(set(failing_shapes)) == 2  # no shape compiled twice
