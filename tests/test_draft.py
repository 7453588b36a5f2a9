"""EAGLE-1 / EAGLE-3 draft heads: loading the public layouts, paged == dense == an independent
plain-torch re-implementation of the reference formulas, per-layer metadata, and loader errors."""
from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.draft import DraftConfig, EagleDraft, load_draft
from compiled_spec.draft.testing import write_eagle1_head, write_eagle3_head
from compiled_spec.models import load_model

H = 64
HEADS = {  # id -> (method, num_layers, writer kwargs)
    "e1-1": ("eagle", 1, {}),
    "e1-2-embed-bias": ("eagle", 2, dict(with_embed=True, bias=True)),
    "e1-3": ("eagle", 3, {}),
    "e3-1-midlayer": ("eagle3", 1, dict(use_midlayer_prefix=True)),
    "e3-1-layers0-embed": ("eagle3", 1, dict(use_midlayer_prefix=False, with_embed=True)),
    "e3-2-midlayer-aux": ("eagle3", 2, dict(aux_layer_ids=(1, 4, 8), draft_vocab_size=100)),
    "e3-3-layers0-llama": ("eagle3", 3, dict(use_midlayer_prefix=False,
                                             architecture="LlamaForCausalLM")),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=H, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128))
    with torch.no_grad():  # O(1) embeddings so the draft's inputs are not dominated by hidden
        hf.model.embed_tokens.weight.normal_()
        hf.lm_head.weight.normal_(std=H ** -0.5)
    d = tmp_path_factory.mktemp("target")
    hf.save_pretrained(d)
    return load_model(str(d), torch.float32, "cpu")


def _write(method, num_layers, kw, cfg, path):
    writer = write_eagle1_head if method == "eagle" else write_eagle3_head
    return writer(str(path), cfg, num_layers=num_layers, **kw)


@pytest.fixture(scope="module", params=list(HEADS))
def head(request, target, tmp_path_factory):
    method, n, kw = HEADS[request.param]
    path = _write(method, n, kw, target[1], tmp_path_factory.mktemp(request.param))
    return method, n, kw, path, load_draft(path, target[0], torch.float32, "cpu")


def _meta(slots, tables, lens, q_lens):
    width = max(len(r) for r in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([r + [-1] * (width - len(r)) for r in tables],
                                  dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(),
                                     dtype=torch.int32),
        max_query_len=max(q_lens), max_seq_len=max(lens))


def run_paged(draft, ids, hidden, schedule, page_size=4, seed=0, swap_step=None):
    """Feed sequences through ``draft.forward`` in steps (``schedule[s][b]`` new tokens of seq b).
    Every layer gets its own shuffled block tables over a garbage-filled cache. ``swap_step``:
    from that step on, layer 1 is (wrongly) given layer 0's metadata."""
    g = torch.Generator().manual_seed(seed)
    n_layers = draft.config.num_hidden_layers
    need = [math.ceil(len(s) / page_size) for s in ids]
    num_blocks = sum(need) + 3
    tables = []
    for _ in range(n_layers):
        perm, rows = torch.randperm(num_blocks, generator=g).tolist(), []
        for n in need:
            rows.append(perm[:n])
            perm = perm[n:]
        tables.append(rows)
    shape = (num_blocks, page_size, draft.config.num_key_value_heads, draft.config.head_dim)
    caches = [(100 * torch.randn(shape, generator=g), 100 * torch.randn(shape, generator=g))
              for _ in range(n_layers)]
    before = [k.clone() for k, _ in caches]
    draft.bind_kv_cache(caches)
    done, outs = [0] * len(ids), [[] for _ in ids]
    for s, step in enumerate(schedule):
        members = [b for b, n in enumerate(step) if n]
        tok = [(b, p) for b in members for p in range(done[b], done[b] + step[b])]
        lens = [done[b] + step[b] for b in members]
        metas = {f"layers.{layer}": _meta(
            [tables[layer][b][p // page_size] * page_size + p % page_size for b, p in tok],
            [tables[layer][b] for b in members], lens, [step[b] for b in members])
            for layer in range(n_layers)}
        if swap_step is not None and s >= swap_step:
            metas["layers.1"] = metas["layers.0"]
        with torch.no_grad():
            fb, fl = draft(torch.tensor([ids[b][p] for b, p in tok]),
                           torch.stack([hidden[b][p] for b, p in tok]),
                           torch.tensor([p for _, p in tok]), metas)
        start = 0
        for b in members:
            outs[b].append((fb[start:start + step[b]], fl[start:start + step[b]]))
            start += step[b]
            done[b] += step[b]
    # Per layer: which flat slots of its own cache were written.
    written = [(c[0] != b0).any(-1).any(-1).flatten().nonzero().flatten().tolist()
               for c, b0 in zip(caches, before)]
    own = [sorted(blk * page_size + p % page_size for b in range(len(ids))
                  for p in range(len(ids[b])) for blk in [tables[layer][b][p // page_size]])
           for layer in range(n_layers)]
    return [tuple(torch.cat(x) for x in zip(*o)) for o in outs], written, own


# --- an independent plain-torch re-implementation, from the raw checkpoint tensors -------------

def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):  # [S, heads, D]
    d = x.shape[-1]
    ang = pos[:, None].float() * (1.0 / theta ** (torch.arange(0, d, 2).float() / d))[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def _attn(x, w, p, c, pos):
    s, nh, kvh, d = x.shape[0], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    q = _rope((x @ w[p + "self_attn.q_proj.weight"].T).view(s, nh, d), pos, c["rope_theta"])
    k = _rope((x @ w[p + "self_attn.k_proj.weight"].T).view(s, kvh, d), pos, c["rope_theta"])
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(s, kvh, d)
    kv_of = torch.arange(nh) // (nh // kvh)
    scores = torch.einsum("qhd,khd->hqk", q, k[:, kv_of]) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[:, kv_of]).reshape(s, nh * d)
    return out @ w[p + "self_attn.o_proj.weight"].T


def _mlp(x, w, p):
    gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def reference(path, target, ids, target_states):
    """Reference doc formulas. EAGLE-1: ``target_states`` = [final normed hidden]; EAGLE-3: the
    aux states. Returns (feed_back, logits over the target vocab ids the head can emit)."""
    w = load_file(os.path.join(path, "model.safetensors"))
    c = json.load(open(os.path.join(path, "config.json")))
    eps, pos = c["rms_norm_eps"], torch.arange(len(ids))
    emb = (w["embed_tokens.weight"] if "embed_tokens.weight" in w
           else target.model.embed_tokens.weight)[ids]
    eagle3 = "d2t" in w
    if eagle3:
        p0 = "midlayer." if any(k.startswith("midlayer.") for k in w) else "layers.0."
        hidden = torch.cat(target_states, -1) @ w["fc.weight"].T
        a_in = torch.cat((_rms(emb, w[p0 + "input_layernorm.weight"], eps),
                          _rms(hidden, w[p0 + "hidden_norm.weight"], eps)), -1)
        x = hidden + _attn(a_in, w, p0, c, pos)
    else:
        p0 = "layers.0."
        x = torch.cat((emb, target_states[0]), -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        x = x + _attn(x, w, p0, c, pos)
    x = x + _mlp(_rms(x, w[p0 + "post_attention_layernorm.weight"], eps), w, p0)
    for i in range(1, c["num_hidden_layers"]):
        p = f"layers.{i}."
        x = x + _attn(_rms(x, w[p + "input_layernorm.weight"], eps), w, p, c, pos)
        x = x + _mlp(_rms(x, w[p + "post_attention_layernorm.weight"], eps), w, p)
    if eagle3:
        return x, _rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T
    return x, x @ target.lm_head.weight.T


# --- tests ------------------------------------------------------------------------------------

def test_load_layout_and_api(head, target):
    method, n, kw, path, draft = head
    tmodel, tcfg = target
    cfg = draft.config
    assert (cfg.method, cfg.num_hidden_layers, cfg.hidden_size) == (method, n, H)
    assert draft.layer_names == [f"layers.{i}" for i in range(n)]
    ckpt = {k.replace("midlayer.", "layers.0.") for k in load_file(f"{path}/model.safetensors")}
    assert set(draft.state_dict()) == ckpt - {"t2d"}  # draft keys only, target not registered
    ids = torch.tensor([5, 17, 255, 0])
    if kw.get("with_embed"):
        assert not torch.equal(draft.embed(ids), tmodel.embed(ids))
    else:  # shared with the target, not copied
        assert torch.equal(draft.embed(ids), tmodel.embed(ids))
    vocab = cfg.draft_vocab_size
    probs = torch.softmax(torch.randn(3, vocab), -1)
    spread = draft.draft_vocab_to_target_probs(probs, tcfg.vocab_size)  # [3, 256]
    draft_ids = torch.arange(vocab)
    tids = draft.draft_to_target(draft_ids)
    assert torch.allclose(spread.sum(-1), torch.ones(3)) and torch.equal(spread[:, tids], probs)
    if method == "eagle":
        assert cfg.aux_layer_ids == () and vocab == tcfg.vocab_size and torch.equal(tids, draft_ids)
        assert cfg.bias == kw.get("bias", False) and (draft.fc.bias is not None) == cfg.bias
        aux = [torch.randn(4, H)]
        assert draft.combine_aux(aux) is aux[0]
        x = torch.randn(4, H)
        assert torch.equal(draft.compute_logits(x), tmodel.compute_logits(x))
    else:
        assert cfg.aux_layer_ids == kw.get("aux_layer_ids", (2, 4, 5))
        d2t = load_file(f"{path}/model.safetensors")["d2t"]
        assert draft.d2t.dtype == torch.int64 and torch.equal(tids, draft_ids + d2t)
        assert bool((tids[1:] > tids[:-1]).all()) and int(tids.max()) < tcfg.vocab_size
        aux = [torch.randn(4, H) for _ in range(3)]
        assert draft.combine_aux(aux).shape == (4, H)
        # as CUDA graphs hand them over: concatenated in the graph (engine.graphs.with_logits)
        assert torch.equal(draft.combine_aux([torch.cat(aux, -1)]), draft.combine_aux(aux))
        with pytest.raises(ValueError, match=f"width {3 * H}, got {2 * H}"):
            draft.combine_aux([torch.cat(aux[:2], -1)])
        # written into a graph's input buffer (precombine): the same values, in place
        buf = torch.zeros(6, H)
        with torch.inference_mode():  # as the engine runs it
            got = draft.combine_aux(aux, out=buf[:4])
            assert got.data_ptr() == buf.data_ptr()
            assert torch.equal(buf[:4], draft.combine_aux(aux))
            draft.fc.bias = torch.nn.Parameter(torch.randn(H))  # addmm, as nn.Linear's
            try:
                assert torch.equal(draft.combine_aux(aux, out=buf[:4]), draft.combine_aux(aux))
            finally:
                draft.fc.bias = None
        assert draft.compute_logits(torch.randn(4, H)).shape == (4, vocab)
    assert draft.compute_logits(torch.randn(2, H)).dtype == torch.float32


def test_paged_matches_dense_over_batch(head):
    method, n, _, _, draft = head
    g = torch.Generator().manual_seed(1)
    lens = [6, 11, 3]
    ids = [torch.randint(0, 256, (m,), generator=g).tolist() for m in lens]
    hidden = [torch.randn(m, H, generator=g) for m in lens]
    # Step 0: prefill chunks of every sequence; then a multi-token chunk and decodes.
    outs, written, own = run_paged(draft, ids, hidden, [[4, 7, 3], [2, 3, 0], [0, 1, 0]])
    for b, m in enumerate(lens):
        with torch.no_grad():
            fb, fl = draft.forward_dense(torch.tensor([ids[b]]), hidden[b][None],
                                         torch.arange(m)[None])
        assert outs[b][0].shape == (m, H) and fb.shape == (1, m, H)
        assert (outs[b][0] - fb[0]).abs().max() <= 1e-5, f"{method}/{n} feed_back seq {b}"
        assert (outs[b][1] - fl[0]).abs().max() <= 1e-5, f"{method}/{n} for_logits seq {b}"
        assert (method == "eagle") == torch.equal(outs[b][0], outs[b][1])
    for layer in range(n):  # each layer wrote exactly the slots of its own block tables
        assert written[layer] == own[layer], f"layer {layer} wrote outside its own table"
    assert n == 1 or own[0] != own[1]


def test_per_layer_metadata_is_used(target, tmp_path):
    path = write_eagle3_head(str(tmp_path), target[1], num_layers=2)
    draft = load_draft(path, target[0], torch.float32, "cpu")
    g = torch.Generator().manual_seed(2)
    ids, hidden = [torch.randint(0, 256, (9,), generator=g).tolist()], [torch.randn(9, H)]
    good = run_paged(draft, ids, hidden, [[6], [3]])[0][0][0]
    bad = run_paged(draft, ids, hidden, [[6], [3]], swap_step=1)[0][0][0]
    # Layer 1 reading its step-0 context through layer 0's table gets garbage.
    assert torch.equal(good[:6], bad[:6]) and (good[6:] - bad[6:]).abs().max() > 1e-2
    meta = _meta([0, 1], [[0]], [2], [2])
    with pytest.raises(ValueError, match=r"'layers\.1'"):
        draft(torch.tensor([1, 2]), torch.randn(2, H), torch.arange(2), {"layers.0": meta})


@pytest.mark.parametrize("name", ["e1-2-embed-bias", "e3-1-midlayer", "e3-3-layers0-llama"])
def test_matches_independent_reference(name, target, tmp_path):
    method, n, kw = HEADS[name]
    tmodel, tcfg = target
    path = _write(method, n, kw, tcfg, tmp_path)
    draft = load_draft(path, tmodel, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (10,), generator=g)
    tmodel.bind_kv_cache([(torch.zeros(3, 4, 2, 16), torch.zeros(3, 4, 2, 16))
                          for _ in range(tcfg.num_hidden_layers)])
    with torch.no_grad():
        final, aux = tmodel(ids, torch.arange(10), _meta(list(range(10)), [[0, 1, 2]], [10], [10]),
                            draft.aux_layer_ids)
        states = aux if method == "eagle3" else [final]
        want_fb, want_logits = reference(path, tmodel, ids, states)
        outs = run_paged(draft, [ids.tolist()], [draft.combine_aux(states)], [[7], [2], [1]])[0]
        logits = draft.compute_logits(outs[0][1])
    assert want_logits.std() > 0.3
    assert (outs[0][0] - want_fb).abs().max() <= 1e-5
    assert (logits - want_logits).abs().max() <= 1e-4


# --- errors -----------------------------------------------------------------------------------

def _edit(path, weights=None, config=None):
    if weights:
        sd = load_file(f"{path}/model.safetensors")
        weights(sd)
        save_file(sd, f"{path}/model.safetensors", metadata={"format": "pt"})
    if config:
        c = json.load(open(f"{path}/config.json"))
        config(c)
        json.dump(c, open(f"{path}/config.json", "w"))


def _load(path, target, **kw):
    return load_draft(str(path), target[0], torch.float32, "cpu", **kw)


def test_head_shapes_must_fit_target(target, tmp_path):
    cfg = target[1]
    p = write_eagle3_head(str(tmp_path / "a"), cfg)
    _edit(p, weights=lambda sd: sd.__setitem__("fc.weight", torch.zeros(H, 96)),
          config=lambda c: c.pop("target_hidden_size"))
    with pytest.raises(ValueError, match=r"fc\.weight.*\(64, 96\).*\(64, 192\)"):
        _load(p, target)
    p = write_eagle3_head(str(tmp_path / "b"), cfg)
    _edit(p, config=lambda c: c.__setitem__("target_hidden_size", 32))
    with pytest.raises(ValueError, match="32.*64"):
        _load(p, target)
    small = replace(cfg, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    with pytest.raises(ValueError, match="32.*64"):  # EAGLE-1 fc [32, 64] for a 64-wide target
        _load(write_eagle1_head(str(tmp_path / "c"), small), target)
    p = write_eagle3_head(str(tmp_path / "d"), cfg, aux_layer_ids=(2, 4, 9))
    with pytest.raises(ValueError, match=r"aux layer id 9 outside \[0, 8\]"):
        _load(p, target)
    p = write_eagle1_head(str(tmp_path / "e"), cfg)
    _edit(p, config=lambda c: c.__setitem__("vocab_size", 300))
    with pytest.raises(ValueError, match="300.*256"):
        _load(p, target)
    p = write_eagle3_head(str(tmp_path / "f"), cfg, draft_vocab_size=100)
    _edit(p, weights=lambda sd: sd["d2t"].__setitem__(99, 200))
    with pytest.raises(ValueError, match=r"draft id 99 to target id 299.*\[0, 256\)"):
        _load(p, target)


def test_strict_keys(target, tmp_path):
    p = write_eagle3_head(str(tmp_path / "a"), target[1])
    _edit(p, weights=lambda sd: sd.pop("midlayer.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing key 'layers\.0\.mlp\.up_proj\.weight'"):
        _load(p, target)
    p = write_eagle1_head(str(tmp_path / "b"), target[1])
    _edit(p, weights=lambda sd: sd.__setitem__("layers.0.input_layernorm.weight", torch.ones(H)))
    with pytest.raises(ValueError, match=r"unexpected key 'layers\.0\.input_layernorm\.weight'"):
        _load(p, target)
    p = write_eagle3_head(str(tmp_path / "c"), target[1], num_layers=2)
    _edit(p, weights=lambda sd: sd.__setitem__("layers.1.self_attn.k_proj.weight",
                                               torch.zeros(32, 2 * H)))
    with pytest.raises(ValueError, match=r"'layers\.1\.self_attn\.k_proj\.weight'.*\(32, 128\)"
                                         r".*\(32, 64\)"):
        _load(p, target)
    p = write_eagle3_head(str(tmp_path / "d"), target[1])
    _edit(p, weights=lambda sd: sd.__setitem__("layers.0.hidden_norm.weight", torch.ones(H)))
    with pytest.raises(ValueError, match="duplicates"):
        _load(p, target)


def test_method_detection_and_contradiction(target, tmp_path):
    e1 = write_eagle1_head(str(tmp_path / "e1"), target[1])
    e3 = write_eagle3_head(str(tmp_path / "e3"), target[1], architecture="LlamaForCausalLM")
    assert _load(e1, target, method="eagle").config.method == "eagle"
    with pytest.raises(ValueError, match=r"method='eagle3'.*'eagle'"):
        _load(e1, target, method="eagle3")
    with pytest.raises(ValueError, match=r"method='eagle'.*'eagle3'"):
        _load(e3, target, method="eagle")
    names = load_file(f"{e3}/model.safetensors").keys()
    raw = json.load(open(f"{e3}/config.json"))
    assert DraftConfig.from_checkpoint(raw, names, target[1]).method == "eagle3"
    assert DraftConfig.from_checkpoint(raw, names, target[1], num_target_layers=32) \
        .aux_layer_ids == (2, 16, 29)
    with pytest.raises(ValueError, match="medusa"):
        replace(DraftConfig.from_checkpoint(raw, names, target[1]), method="medusa")
    assert isinstance(_load(e3, target), EagleDraft)


def test_bad_path_and_config(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        _load(tmp_path / "nope", target)
    p = write_eagle1_head(str(tmp_path / "m"), target[1])
    with open(f"{p}/config.json", "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match=r"malformed JSON in .*config\.json"):
        _load(p, target)
    with open(f"{p}/config.json", "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "vocab_size": 256}, f)
    with pytest.raises(ValueError, match=r"m/config\.json.*'hidden_size'"):
        _load(p, target)
