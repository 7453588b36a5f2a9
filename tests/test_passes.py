"""FX passes and the torch.compile backend (passes/): per-pass toy modules (op counts, match
counts, numerics, uuid), the pipeline's invariants, and end to end through Inductor on a tiny
CausalLM and a tiny 2-layer EAGLE-3 draft with paged KV caches."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from compiled_spec.attention_metadata import AttentionMetadata
from passes import (PASS_ORDER, BindPerLayerAttnMetadata, HoistEagle3Fc, NoOpElimination,
                    PassManager, SkinnyGemmFusion, make_backend)
from passes.graph_utils import PAGED_ATTENTION, WRITE_KV, count_ops, is_op
from passes.pipeline import _copy_graph_module, PlanRunner

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield


def dynamo_graph(fn, *args):
    """The graph Dynamo hands a backend for ``fn(*args)`` (fullgraph, dynamic)."""
    box = {}

    def capture(gm, example_inputs):
        box["gm"] = _copy_graph_module(gm)
        return gm.forward

    torch.compile(fn, backend=capture, fullgraph=True, dynamic=True)(*args)
    return box["gm"]


def compile_spy(backend):
    """(compile fn, record): record["before"] is Dynamo's graph as given to the backend."""
    record = {}

    def spy(gm, example_inputs):
        record["before"] = _copy_graph_module(gm)
        return backend(gm, example_inputs)

    return spy, record


def n_placeholders(gm):
    return sum(n.op == "placeholder" for n in gm.graph.nodes)


def n_calls(gm, *names):
    """call_function/call_method nodes whose target's name is one of ``names``."""
    def name(n):
        return n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return sum(n.op in ("call_function", "call_method") and name(n) in names
               for n in gm.graph.nodes)


def assert_close(a, b):
    for x, y in zip(a if isinstance(a, (tuple, list)) else [a],
                    b if isinstance(b, (tuple, list)) else [b]):
        assert x.shape == y.shape and (x - y).abs().max().item() <= TOL


# --- NoOpElimination ----------------------------------------------------------------------------

class NoOpToy(nn.Module):
    def forward(self, x):  # [T, 8]
        a = x.reshape(x.shape[0], 8)  # same shape: no-op
        b = a.to(torch.float32)  # same dtype: no-op
        c = b[:, :]  # identity slice: no-op
        d = c.contiguous()  # already contiguous: no-op
        e = d.float() * 2  # no-op cast, then real compute
        f = e.view(-1, 4)  # real reshape: kept
        g = f.t().contiguous()  # contiguous on a transposed view: a copy, kept
        return g + 1, x[:, :4] * 1  # partial slice: kept


def test_noop_elimination_counts_and_numerics():
    backend = make_backend(inductor=False)
    spy, rec = compile_spy(backend)
    compiled = torch.compile(NoOpToy(), backend=spy, fullgraph=True, dynamic=True)
    for t in (5, 9):
        x = torch.randn(t, 8)
        assert_close(compiled(x), NoOpToy()(x))
    after = backend.compiled[0].gm
    assert backend.match_counts["NoOpElimination"] == 5
    names = ("reshape", "to", "getitem", "contiguous", "float", "view")
    assert n_calls(rec["before"], *names) == 8
    assert n_calls(after, *names) == 3  # view, contiguous (copy), x[:, :4]
    assert n_calls(after, "view") == 1 and n_calls(after, "contiguous") == 1
    assert not isinstance(backend.compiled[0].fn, PlanRunner)  # nothing to remap: no wrapper


def test_noop_keeps_graph_without_noops():
    gm = dynamo_graph(lambda x: (x.view(-1, 2) * 2).to(torch.float64), torch.randn(4, 4))
    p = NoOpElimination()
    nodes = len(gm.graph.nodes)
    p(gm)
    assert p.match_count == 0 and len(gm.graph.nodes) == nodes


# --- HoistEagle3Fc ------------------------------------------------------------------------------

class FusedToy(nn.Module):
    """fc fused into the forward, not separated: ``h = fc(cat(a, b, c)); out = layer(emb, h)``;
    the second cat -> linear (with a computed embedding) must stay."""

    def __init__(self, h=16, vocab=50):
        super().__init__()
        self.fc = nn.Linear(3 * h, h, bias=True)
        self.embed = nn.Embedding(vocab, h)
        self.layer = nn.Linear(2 * h, h)

    def forward(self, ids, a, b, c):
        h = self.fc(torch.cat([a, b, c], dim=-1))
        return self.layer(torch.cat([self.embed(ids), h], dim=-1)).relu(), h


def _toy_inputs(t, h=16):
    g = torch.Generator().manual_seed(t)
    return (torch.randint(0, 50, (t,), generator=g), *[torch.randn(t, h, generator=g)
                                                       for _ in range(3)])


def test_hoist_fc_fused_toy():
    torch.manual_seed(0)
    model = FusedToy()
    events = []

    def wrap(compiled, gm):  # stands in for a CUDA-graph capture of the remainder
        def run(*args):
            events.append("remainder")
            return compiled(*args)
        return run

    backend = make_backend(inductor=False, wrap_compiled=wrap)
    spy, rec = compile_spy(backend)
    compiled = torch.compile(model, backend=spy, fullgraph=True, dynamic=True)
    runner = None
    for t in (3, 11):  # a variable token count, one compiled graph
        inputs = _toy_inputs(t)
        if runner is not None:
            runner.hoisted = lambda *a, f=runner.hoisted: events.append("fc") or f(*a)
        with torch.no_grad():
            assert_close(compiled(*inputs), model(*inputs))
        runner = backend.compiled[0].fn
    assert len(backend.compiled) == 1 and isinstance(runner, PlanRunner)
    assert events == ["remainder", "fc", "remainder"]  # fc eagerly, before and outside

    before, art = rec["before"], backend.compiled[0]
    assert backend.match_counts["HoistEagle3Fc"] == 1
    assert (n_calls(before, "cat"), n_calls(before, "linear")) == (2, 2)
    assert (n_calls(art.gm, "cat"), n_calls(art.gm, "linear")) == (1, 1)
    assert (n_calls(art.hoisted.module, "cat"), n_calls(art.hoisted.module, "linear")) == (1, 1)
    # a, b, c, fc.weight, fc.bias leave the compiled graph; its fc output comes in.
    assert n_placeholders(art.gm) == n_placeholders(before) - 5 + 1
    assert n_placeholders(art.hoisted.module) == 5


def test_hoist_fc_leaves_unmatched_graphs_alone():
    class Computed(nn.Module):  # the cat reads a computed value: not a hoistable prologue
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 16)

        def forward(self, a, b):
            return self.fc(torch.cat([a, b.relu()], -1))

    model, a, b = Computed(), torch.randn(4, 16), torch.randn(4, 16)
    backend = make_backend(inductor=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        assert_close(compiled(a, b), model(a, b))
    art = backend.compiled[0]
    assert backend.match_counts["HoistEagle3Fc"] == 0 and art.hoisted is None
    assert not isinstance(art.fn, PlanRunner)
    assert n_calls(art.gm, "cat") == 1 and n_calls(art.gm, "linear") == 1


def test_hoist_fc_aten_level_graph():
    """The matcher also reads aten graphs (cat + t + addmm); NoOp drops the same-shape view."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(a, b, c, w, bias, ids, emb, w2):
        h = torch.nn.functional.linear(torch.cat([a, b, c], -1), w, bias)
        x = torch.cat([emb[ids], h], -1) @ w2.T
        return x.reshape(x.shape), h

    args = [torch.randn(5, 16) for _ in range(3)] + [
        torch.randn(16, 48), torch.randn(16), torch.randint(0, 10, (5,)), torch.randn(10, 16),
        torch.randn(16, 32)]
    gm = make_fx(f, tracing_mode="symbolic")(*args)
    hoist, noop = HoistEagle3Fc(), NoOpElimination()
    hoist(gm)
    noop(gm)
    hoisted = gm.meta["compiled_spec_hoisted"].module
    assert (hoist.match_count, noop.match_count) == (1, 1)
    assert count_ops(hoisted, torch.ops.aten.addmm) == 1 and count_ops(gm, torch.ops.aten.cat) == 1
    out = gm(*args[5:], *hoisted(*args[:5]))
    assert_close(out, f(*args))
    assert not any(is_op(n, torch.ops.aten.view, torch.ops.aten.sym_size) for n in gm.graph.nodes)


def test_uuid_stable_and_distinct():
    passes = [NoOpElimination(), HoistEagle3Fc(), BindPerLayerAttnMetadata()]
    ids = [p.uuid() for p in passes]
    assert ids == [p.uuid() for p in passes]
    assert ids == [type(p)().uuid() for p in passes]  # a new instance, same config
    assert len(set(ids)) == 3
    assert HoistEagle3Fc(max_matches=2).uuid() != ids[1]
    assert BindPerLayerAttnMetadata(rewrite_shared=False).uuid() != ids[2]
    assert PassManager(passes).uuid() != PassManager(passes[:2]).uuid()
    code = ("from passes import *; print(NoOpElimination().uuid(), HoistEagle3Fc().uuid(), "
            "BindPerLayerAttnMetadata().uuid())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ids  # stable across processes (keys Inductor's FX graph cache)


# --- BindPerLayerAttnMetadata -------------------------------------------------------------------

H, HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 4, 2, 4, 4


class ToyAttnLayer(nn.Module):
    def __init__(self, cache_shape, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.qkv = nn.Linear(H, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, H, bias=False)
        self.register_buffer("k_cache", torch.randn(cache_shape, generator=g), persistent=False)
        self.register_buffer("v_cache", torch.randn(cache_shape, generator=g), persistent=False)

    def forward(self, x, meta):
        t = x.shape[0]
        q, k, v = self.qkv(x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM,
                                     KV_HEADS * HEAD_DIM], dim=-1)
        q = q.reshape(t, HEADS, HEAD_DIM)
        k, v = k.reshape(t, KV_HEADS, HEAD_DIM), v.reshape(t, KV_HEADS, HEAD_DIM)
        torch.ops.compiled_spec.write_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        out = torch.ops.compiled_spec.paged_attention(
            q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, meta.max_query_len, meta.max_seq_len, HEAD_DIM ** -0.5)
        return x + self.o(out.reshape(t, HEADS * HEAD_DIM))


class ToyDraft(nn.Module):
    """``mode``: "global" (one metadata for every layer, the global-context way), "dict"
    (``metas["layers.i"]`` per layer, like EagleDraft) or "swapped" (layer i reads the metadata
    of layer n-1-i: miswired)."""

    def __init__(self, mode, n=3, cache_shapes=None):
        super().__init__()
        self.mode = mode
        shapes = cache_shapes or [(12, PAGE, KV_HEADS, HEAD_DIM)] * n
        torch.manual_seed(1)
        self.layers = nn.ModuleList(ToyAttnLayer(s, seed=i) for i, s in enumerate(shapes))

    def forward(self, x, metas):
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            if self.mode == "global":
                x = layer(x, metas)
            else:
                x = layer(x, metas[f"layers.{n - 1 - i if self.mode == 'swapped' else i}"])
        return x


def make_meta(q_lens, ctx_lens, table, page=PAGE):
    """Metadata for sequences with ``ctx_lens`` tokens already cached (any content) and
    ``q_lens`` new ones; ``table`` maps (seq, logical block) -> physical block."""
    slots = [table[b][p // page] * page + p % page
             for b, (q, c) in enumerate(zip(q_lens, ctx_lens)) for p in range(c, c + q)]
    lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    width = max(len(r) for r in table)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([r + [0] * (width - len(r)) for r in table], dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(),
                                     dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(lens))


TABLE_A = [[0, 1, 2], [3, 4, 5]]
TABLE_B = [[7, 9, 11], [6, 8, 10]]  # same shapes, other blocks


def _caches(model):
    return [(m.k_cache.clone(), m.v_cache.clone()) for m in model.layers]


def test_bind_rewrites_shared_metadata_per_layer():
    model, ref = ToyDraft("global"), ToyDraft("global")
    meta_a = make_meta([3, 2], [4, 5], TABLE_A)
    meta_b = make_meta([3, 2], [4, 5], TABLE_B)
    x = torch.randn(5, H)
    backend = make_backend(inductor=False)
    spy, rec = compile_spy(backend)
    compiled = torch.compile(model, backend=spy, fullgraph=True, dynamic=True)
    with torch.no_grad():
        assert_close(compiled(x, meta_a), ref(x, meta_a))  # unbound: shared metadata
        for (k, v), (rk, rv) in zip(_caches(model), _caches(ref)):
            assert torch.equal(k, rk) and torch.equal(v, rv)
        # Bind layer 1 to other blocks: the compiled model must act like per-layer metadata.
        backend.bind_layer_metadata({"layers.1": meta_b})
        out = compiled(x, meta_a)
        y = x
        for i, layer in enumerate(ref.layers):
            y = layer(y, meta_b if i == 1 else meta_a)
        assert_close(out, y)
        for (k, v), (rk, rv) in zip(_caches(model), _caches(ref)):
            assert (k - rk).abs().max() <= TOL and (v - rv).abs().max() <= TOL
        backend.bind_layer_metadata({"layers.1": make_meta([3, 2], [4, 5], [[0, 1, 2, 3]] * 2)})
        with pytest.raises(ValueError, match="layers.1.block_tables"):
            compiled(x, meta_a)
    art = backend.compiled[0]
    assert backend.match_counts["BindPerLayerAttnMetadata"] == 3
    assert backend.graphs[0].details["BindPerLayerAttnMetadata"] == {
        "verified": [], "rewritten": ["layers.0", "layers.1", "layers.2"]}
    # 4 tensor fields per layer become inputs; attention/write nodes stay one per layer.
    assert n_placeholders(art.gm) == n_placeholders(rec["before"]) + 3 * 4
    assert count_ops(art.gm, PAGED_ATTENTION) == count_ops(art.gm, WRITE_KV) == 3
    for node in art.gm.graph.nodes:
        if is_op(node, PAGED_ATTENTION):
            assert node.args[3].name.endswith("__block_tables")


def test_bind_verifies_per_layer_dict_metadata():
    metas = {f"layers.{i}": make_meta([3, 2], [4, 5], t)
             for i, t in enumerate([TABLE_A, TABLE_B, TABLE_A])}
    x = torch.randn(5, H)
    gm = dynamo_graph(ToyDraft("dict"), x, metas)
    placeholders = n_placeholders(gm)
    p = BindPerLayerAttnMetadata()
    p(gm)
    assert p.match_count == 3 and p.verified == ["layers.0", "layers.1", "layers.2"]
    assert p.rewritten == [] and n_placeholders(gm) == placeholders
    # One seq_lens / query_start_loc tensor for every layer is fine: they describe the batch.
    for m in metas.values():
        m.seq_lens = metas["layers.0"].seq_lens
        m.query_start_loc = metas["layers.0"].query_start_loc
    p(dynamo_graph(ToyDraft("dict"), x, metas))
    assert p.verified == ["layers.0", "layers.1", "layers.2"] and p.rewritten == []

    with pytest.raises(ValueError, match="'layers.0' reads the metadata of 'layers.2'"):
        BindPerLayerAttnMetadata()(dynamo_graph(ToyDraft("swapped"), x, metas))


def test_bind_refuses_different_kv_layouts():
    shapes = [(12, PAGE, KV_HEADS, HEAD_DIM), (6, 2 * PAGE, KV_HEADS, HEAD_DIM)]
    metas = {f"layers.{i}": make_meta([3, 2], [4, 5], TABLE_A) for i in range(2)}
    gm = dynamo_graph(ToyDraft("dict", cache_shapes=shapes), torch.randn(5, H), metas)
    with pytest.raises(ValueError, match=r"layers\.1 k_cache is \[6, 8, 2, 4\].*layers\.0 "
                                         r"k_cache is \[12, 4, 2, 4\]"):
        BindPerLayerAttnMetadata()(gm)


# --- pipeline -----------------------------------------------------------------------------------

def test_pass_order_dumps_and_attention_guard(tmp_path, monkeypatch):
    pm = PassManager([BindPerLayerAttnMetadata(), SkinnyGemmFusion(), NoOpElimination(),
                      HoistEagle3Fc()])
    assert [type(p) for p in pm.passes] == PASS_ORDER
    metas = {f"layers.{i}": make_meta([3, 2], [4, 5], TABLE_A) for i in range(3)}
    x = torch.randn(5, H)

    monkeypatch.delenv("COMPILED_SPEC_DUMP_GRAPHS", raising=False)
    quiet = NoOpElimination()
    quiet(dynamo_graph(NoOpToy(), torch.randn(4, 8)))
    assert quiet.match_count == 5
    assert quiet.last_before is None and quiet.last_after is None  # off: nothing printed
    kept = NoOpElimination(keep_graphs=True)
    kept(dynamo_graph(NoOpToy(), torch.randn(4, 8)))
    assert ".contiguous()" in kept.last_before and kept.last_before != kept.last_after
    monkeypatch.setenv("COMPILED_SPEC_DUMP_GRAPHS", str(tmp_path))
    NoOpElimination()(dynamo_graph(NoOpToy(), torch.randn(4, 8)))
    assert sorted(f.name.split("-", 2)[2] for f in tmp_path.iterdir()) == [
        "NoOpElimination-after.py", "NoOpElimination-before.py"]
    monkeypatch.delenv("COMPILED_SPEC_DUMP_GRAPHS")

    class DropAttention(NoOpElimination):  # a broken pass
        name = "DropAttention"

        def apply(self, gm):
            node = next(n for n in gm.graph.nodes if is_op(n, PAGED_ATTENTION))
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            return 1

    with pytest.raises(AssertionError, match="DropAttention changed"):
        PassManager([DropAttention()])(dynamo_graph(ToyDraft("dict"), x, metas))


# --- end to end: real models through Inductor ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from compiled_spec.models import load_model

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    with torch.no_grad():
        hf.model.embed_tokens.weight.normal_()
    d = tmp_path_factory.mktemp("target")
    hf.save_pretrained(d)
    return load_model(str(d), torch.float32, "cpu")


def paged_setup(num_layers, kv_heads, head_dim, q_lens, ctx_lens, seed):
    """Per layer: garbage-filled (k, v) caches and metadata over its own shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil((q + c) / PAGE) for q, c in zip(q_lens, ctx_lens)]
    num_blocks = 16  # fixed, as the engine's pool: cache shapes are static in the graph
    caches, metas = [], []
    for _ in range(num_layers):
        perm, table = torch.randperm(num_blocks, generator=g).tolist(), []
        for n in need:
            table.append(perm[:n])
            perm = perm[n:]
        metas.append(make_meta(q_lens, ctx_lens, table))
        shape = (num_blocks, PAGE, kv_heads, head_dim)
        caches.append((torch.randn(shape, generator=g), torch.randn(shape, generator=g)))
    return caches, metas


def clone_caches(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


def assert_caches_close(a, b):
    for (k, v), (rk, rv) in zip(a, b):
        assert (k - rk).abs().max() <= TOL and (v - rv).abs().max() <= TOL


def test_e2e_causal_lm_inductor(tiny_target):
    model, cfg = tiny_target
    backend = make_backend(hoist_fc=False, per_layer_metadata=False)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    for step, (q_lens, ctx) in enumerate([([3, 4], [0, 2]), ([1, 5], [6, 1])]):
        caches, metas = paged_setup(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                    cfg.head_dim, q_lens, ctx, seed=step)
        t = sum(q_lens)
        ids = torch.randint(0, cfg.vocab_size, (t,))
        pos = torch.cat([torch.arange(c, c + q) for q, c in zip(q_lens, ctx)])
        with torch.no_grad():
            eager_caches = clone_caches(caches)
            model.bind_kv_cache(eager_caches)
            ref = model(ids, pos, metas[0], (1, 3))
            model.bind_kv_cache(caches)
            out = compiled(ids, pos, metas[0], (1, 3))
        assert_close([out[0], *out[1]], [ref[0], *ref[1]])
        assert_caches_close(caches, eager_caches)
    assert len(backend.graphs) == 1  # dynamic: both token counts share one graph
    # Our cache-key pass (pipeline uuid) keeps Inductor's FX graph cache usable.
    inductor_counters = torch._dynamo.utils.counters["inductor"]
    assert inductor_counters["fxgraph_cache_bypass"] == 0
    assert inductor_counters["fxgraph_cache_miss"] + inductor_counters["fxgraph_cache_hit"] >= 1
    stats = backend.stats
    assert stats["graphs"] == 1 and set(stats["pass_matches"]) == {
        "NoOpElimination", "UnfuseResidualAddmm"}
    assert stats["per_graph"][0]["inductor"] and stats["per_graph"][0][
        "paged_attention_nodes"] == cfg.num_hidden_layers


class FirstDraftPass(nn.Module):
    """The draft's first pass as the proposer runs it: combine_aux (the EAGLE-3 fc) + forward,
    traced as one graph; the backend must split the fc back out."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def forward(self, ids, aux, positions, attn_metas):
        return self.draft(ids, self.draft.combine_aux(aux), positions, attn_metas)


def eagle3_draft(tiny_target, directory):
    from compiled_spec.draft import load_draft
    from compiled_spec.draft.testing import write_eagle3_head

    target, tcfg = tiny_target
    path = write_eagle3_head(str(directory), tcfg, num_layers=2, aux_layer_ids=(0, 1, 3))
    return load_draft(path, target, torch.float32, "cpu")


def draft_inputs(draft, tcfg, q_lens, ctx):
    t = sum(q_lens)
    ids = torch.randint(0, tcfg.vocab_size, (t,))
    aux = [torch.randn(t, tcfg.hidden_size) for _ in draft.config.aux_layer_ids]
    pos = torch.cat([torch.arange(c, c + q) for q, c in zip(q_lens, ctx)])
    return ids, aux, pos


def test_e2e_eagle3_draft_inductor(tiny_target, tmp_path):
    tcfg = tiny_target[1]
    draft = eagle3_draft(tiny_target, tmp_path / "head")
    cfg = draft.config
    first = FirstDraftPass(draft)
    backend = make_backend(hoist_fc=True)
    compiled = torch.compile(first, backend=backend, fullgraph=True, dynamic=True)
    for step, (q_lens, ctx) in enumerate([([3, 2], [4, 0]), ([6, 1], [2, 5])]):
        caches, metas = paged_setup(cfg.num_hidden_layers, cfg.num_key_value_heads,
                                    cfg.head_dim, q_lens, ctx, seed=10 + step)
        attn_metas = dict(zip(draft.layer_names, metas))
        ids, aux, pos = draft_inputs(draft, tcfg, q_lens, ctx)
        with torch.no_grad():
            eager_caches = clone_caches(caches)
            draft.bind_kv_cache(eager_caches)
            ref = first(ids, aux, pos, attn_metas)
            draft.bind_kv_cache(caches)
            out = compiled(ids, aux, pos, attn_metas)
        assert_close(out, ref)
        assert_caches_close(caches, eager_caches)
        for (k, _), (k0, _) in zip(caches, paged_setup(
                cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, q_lens, ctx,
                seed=10 + step)[0]):
            assert not torch.equal(k, k0)  # the compiled graph did write the caches
    assert len(backend.compiled) == 1
    art, stats = backend.compiled[0], backend.graphs[0]
    assert stats.matches["HoistEagle3Fc"] == 1 and art.hoisted is not None
    assert stats.matches["BindPerLayerAttnMetadata"] == cfg.num_hidden_layers
    assert stats.details["BindPerLayerAttnMetadata"]["verified"] == draft.layer_names
    assert stats.paged_attention_nodes == cfg.num_hidden_layers
    # The fc (3h -> h) is only in the eager part; the compiled graph takes its output.
    fc_shape = (cfg.hidden_size, 3 * tcfg.hidden_size)
    for gm, expect in ((art.hoisted.module, 1), (art.gm, 0)):
        vals = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        assert sum(getattr(v, "shape", None) == fc_shape for v in vals) == expect
    assert any(n.name.startswith("hoisted_fc") for n in art.gm.graph.nodes)


def test_draft_with_one_metadata_object_gets_per_layer_inputs(tiny_target, tmp_path):
    """The proposer passes ``{name: meta for name in layers}``: Dynamo sees one set of tensors,
    the pass splits it per layer, and binding per-layer metadata then acts like passing it."""
    tcfg = tiny_target[1]
    draft = eagle3_draft(tiny_target, tmp_path / "head")
    cfg = draft.config
    q_lens, ctx = [3, 2], [4, 0]
    caches, metas = paged_setup(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                q_lens, ctx, seed=3)
    ids, aux, pos = draft_inputs(draft, tcfg, q_lens, ctx)
    shared = dict.fromkeys(draft.layer_names, metas[0])
    per_layer = dict(zip(draft.layer_names, metas))
    backend = make_backend(inductor=False)
    compiled = torch.compile(FirstDraftPass(draft), backend=backend, fullgraph=True,
                             dynamic=True)
    with torch.no_grad():
        for bound, eager_metas in ((None, shared), (per_layer, per_layer)):
            backend.bind_layer_metadata(bound)
            eager_caches = clone_caches(caches)
            draft.bind_kv_cache(eager_caches)
            ref = draft(ids, draft.combine_aux(aux), pos, eager_metas)
            got_caches = clone_caches(caches)
            draft.bind_kv_cache(got_caches)
            assert_close(compiled(ids, aux, pos, shared), ref)
            assert_caches_close(got_caches, eager_caches)
    stats = backend.graphs[0]
    assert len(backend.graphs) == 1 and stats.matches["HoistEagle3Fc"] == 1
    assert stats.details["BindPerLayerAttnMetadata"] == {"verified": [],
                                                         "rewritten": draft.layer_names}
