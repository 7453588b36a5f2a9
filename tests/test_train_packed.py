"""The packed TTT path (``ttt_packed.py``, ``soft_ce.py``, ``packing.py``) against the padded
reference (``ttt.py``, which ``test_train.py`` ties to paged inference)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compiled_spec.draft.loader import load_draft
from compiled_spec.draft.testing import write_eagle3_head
from compiled_spec.models.loader import load_model
from compiled_spec.train.data import TrainSequence, collate, pack_batches
from compiled_spec.train.features import TargetFeaturizer
from compiled_spec.train.packing import collate_packed
from compiled_spec.train.soft_ce import soft_cross_entropy
from compiled_spec.train.ttt import ttt_loss
from compiled_spec.train.ttt_packed import PackedTTTMask, packed_ttt_loss
from tests.spec_models import write_bigram_target


def _seqs(lengths: list[int], vocab: int, seed: int = 0) -> list[TrainSequence]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        # single replies, multi-turn spans, a reply too short to train on
        spans = [(min(2, n - 1), n)] if i % 2 else [(1, min(4, n)), (min(6, n), n)]
        out.append(TrainSequence(str(i), ids, spans[0][0], spans))
    return out


@pytest.mark.parametrize("chunk,temp", [(5, 1.0), (64, 1.0), (1000, 1.0), (5, 0.5), (64, 0.25)])
@pytest.mark.parametrize("train_w", [False, True])
def test_soft_ce_equals_unfused_loss_and_gradients(chunk, temp, train_w):
    g = torch.Generator().manual_seed(1)
    n, h, v = 37, 16, 50
    x = torch.randn(n, h, generator=g, requires_grad=True)
    w = torch.randn(v, h, generator=g, requires_grad=train_w)
    th, tw = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    weight = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.3)
    loss, ce, hits = soft_cross_entropy(x, w, th, tw, weight, chunk, label_temperature=temp)
    (loss * 3).backward()
    grads = (x.grad.clone(), w.grad.clone() if train_w else None)
    x.grad = None
    w.grad = None
    ld, lt = x @ w.t(), th @ tw.t()
    ref_ce = -(torch.softmax(lt / temp, -1) * torch.log_softmax(ld, -1)).sum(-1)
    ref = (ref_ce * weight).sum()
    (ref * 3).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce, ref_ce, rtol=1e-5, atol=1e-6)
    assert torch.equal(hits, ld.argmax(-1) == lt.argmax(-1))
    torch.testing.assert_close(grads[0], x.grad, rtol=1e-5, atol=1e-6)
    if train_w:
        torch.testing.assert_close(grads[1], w.grad, rtol=1e-5, atol=1e-6)
    assert not ce.requires_grad and not hits.requires_grad


def test_a_cold_label_temperature_is_the_hard_label_loss():
    """--label-temperature -> 0: the labels become the target's argmax, so the loss is the
    plain cross-entropy against it; a temperature of 0 or below, or with the padded path, is
    refused by name."""
    g = torch.Generator().manual_seed(2)
    n, h, v = 29, 16, 40
    x, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    th, tw = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    weight = torch.ones(n)
    _, ce, _ = soft_cross_entropy(x, w, th, tw, weight, 8, label_temperature=1e-4)
    hard = torch.nn.functional.cross_entropy(x @ w.t(), (th @ tw.t()).argmax(-1), reduction="none")
    torch.testing.assert_close(ce, hard, rtol=1e-5, atol=1e-5)
    _, soft, _ = soft_cross_entropy(x, w, th, tw, weight, 8)
    assert not torch.allclose(soft, hard, atol=1e-2)
    with pytest.raises(ValueError, match="label_temperature"):
        soft_cross_entropy(x, w, th, tw, weight, 8, label_temperature=0.0)
    from compiled_spec.train.trainer import TrainConfig
    assert TrainConfig(target="t", prompts="p", out="o", label_temperature=0.5
                       ).label_temperature == 0.5
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match="label_temperature"):
            TrainConfig(target="t", prompts="p", out="o", label_temperature=bad)
    with pytest.raises(ValueError, match="label_temperature"):
        TrainConfig(target="t", prompts="p", out="o", label_temperature=0.5, ttt_impl="padded")


def test_pack_batches_cover_each_sequence_once_within_the_budget():
    g = torch.Generator().manual_seed(4)
    lengths = torch.randint(3, 300, (500,), generator=g).tolist()
    plan = pack_batches(lengths, 1024, seed=3)
    assert sorted(i for b in plan for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 1024 for b in plan)
    assert sum(lengths) / (1024 * len(plan)) > 0.9  # packed, not one sequence per batch
    assert plan == pack_batches(lengths, 1024, seed=3) != pack_batches(lengths, 1024, seed=4)
    with pytest.raises(ValueError, match="1025 tokens"):
        pack_batches([1025], 1024, seed=0)


@pytest.mark.parametrize("step", [1, 2, 4])
def test_block_mask_equals_the_dense_mask(step):
    from torch.nn.attention.flex_attention import create_block_mask

    lengths = [5, 130, 1, 250, 9, 200]  # crossing 128-row blocks; the tail is 1.1 blocks
    batch = collate_packed(_seqs(lengths, 20), 768, "cpu")
    mask = PackedTTTMask(batch.positions, 4, flex=True)
    dense = torch.cat([mask.dense(step), torch.zeros(768, (4 - step) * 768, dtype=torch.bool)], 1)
    ours = mask.block(step)
    assert torch.equal(ours.to_dense().bool(), create_block_mask(
        lambda b, h, q, kv: mask.allowed(q, kv, step), None, None, 768, 4 * 768,
        device="cpu").to_dense().bool())
    # Block-level coverage is exact: a block is kept iff it holds a visible key, and "full"
    # blocks (no mask_mod evaluated) hold only visible keys.
    blocks = dense.view(6, 128, 24, 128).permute(0, 2, 1, 3).reshape(6, 24, -1)
    full = torch.zeros(6, 24, dtype=torch.bool)
    fnum, fidx = ours.full_kv_num_blocks[0, 0], ours.full_kv_indices[0, 0]
    for r in range(6):
        full[r, fidx[r, :fnum[r]].long()] = True
    assert torch.equal(full, blocks.all(-1))
    assert torch.equal(ours.to_dense()[0, 0].bool(), blocks.any(-1))
    # Every query sees at least one key (its own entry of this step).
    assert dense.any(1).all()


def test_flex_forward_equals_dense_attention_on_cpu():
    """Flex attention's CPU forward (no backward there) over our BlockMask == SDPA over the
    dense mask; the GPU run checks gradients too (profiles/scripts/train_speed_h200.py)."""
    from torch.nn.attention.flex_attention import flex_attention

    batch = collate_packed(_seqs([40, 100, 7, 90], 20), 256, "cpu")
    mask = PackedTTTMask(batch.positions, 3, flex=True)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 256, 8, generator=g)
    k, v = torch.randn(1, 2, 3 * 256, 8, generator=g), torch.randn(1, 2, 3 * 256, 8, generator=g)
    for step in (1, 2, 3):
        k_s, v_s = k.clone(), v.clone()
        k_s[:, :, step * 256:] = 0  # steps not run yet: zeros, as the trainer's buffer
        v_s[:, :, step * 256:] = 0
        out = flex_attention(q, k_s, v_s, block_mask=mask.block(step), enable_gqa=True)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q, k[:, :, :step * 256].repeat_interleave(2, 1),
            v[:, :, :step * 256].repeat_interleave(2, 1), attn_mask=mask.dense(step))
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def target_and_head(tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    write_bigram_target(d / "t", vocab=48, hidden=32, layers=4, seed=3)
    target, tcfg = load_model(str(d / "t"), torch.float32, "cpu")
    path = write_eagle3_head(str(d / "head"), tcfg, num_layers=2, draft_vocab_size=48,
                             aux_layer_ids=(0, 2, 4), seed=1)
    return target, path


@pytest.mark.parametrize("steps", [1, 4])
def test_packed_loss_and_gradients_equal_the_padded_reference(target_and_head, steps):
    target, path = target_and_head
    seqs = _seqs([13, 7, 20, 3, 31, 2], 48, seed=steps)
    results = []
    for packed in (True, False):
        draft = load_draft(path, target, torch.float32, "cpu")
        for p in draft.parameters():
            p.requires_grad_(True)
        feats = TargetFeaturizer(target, draft.aux_layer_ids, torch.arange(48))
        if packed:
            batch = collate_packed(seqs, 128, "cpu")
            aux, final = feats.packed(batch)
            res = packed_ttt_loss(draft, batch, aux, final, feats.head, steps, 0.8, chunk=16)
        else:
            batch = collate(seqs, "cpu")
            aux, tl = feats(batch.input_ids, batch.lengths)
            res = ttt_loss(draft, batch.input_ids, aux, tl, batch.loss_mask, steps, 0.8)
        res.loss.backward()
        results.append((res, {n: p.grad.clone() for n, p in draft.named_parameters()
                              if p.grad is not None}))
    (a, ga), (b, gb) = results
    assert a.step_counts == b.step_counts and a.step_counts[0] > 0
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    for x, y in zip(a.step_losses + a.step_accuracy, b.step_losses + b.step_accuracy):
        assert x == pytest.approx(y, rel=1e-5, abs=1e-6)
    assert ga.keys() == gb.keys() and "lm_head.weight" in ga
    for n in ga:
        torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6)


def test_compiled_ttt_step_equals_eager(target_and_head):
    """--compile-ttt: the TTT step's dense pieces through torch.compile (Inductor's C++ code
    here) give the eager loss, per-step figures and gradients, over a 2-layer head (layer 0,
    EAGLE-3's first, and a plain layer: two graph classes) and 3 steps, twice (the second call
    reuses the compiles); a padded run is refused by name."""
    from compiled_spec.train.config import TrainConfig

    target, path = target_and_head
    seqs = _seqs([13, 7, 20, 3, 31, 2], 48, seed=5)
    batch = collate_packed(seqs, 128, "cpu")
    results = []
    for compiled in (False, True, True):
        draft = load_draft(path, target, torch.float32, "cpu")
        for p in draft.parameters():
            p.requires_grad_(True)
        feats = TargetFeaturizer(target, draft.aux_layer_ids, torch.arange(48))
        aux, final = feats.packed(batch)
        res = packed_ttt_loss(draft, batch, aux, final, feats.head, 3, 0.8, chunk=16,
                              compiled=compiled)
        res.loss.backward()
        results.append((res, {n: p.grad.clone() for n, p in draft.named_parameters()
                              if p.grad is not None}))
    (a, ga), *rest = results
    for b, gb in rest:
        torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
        assert a.step_counts == b.step_counts
        for x, y in zip(a.step_losses + a.step_accuracy, b.step_losses + b.step_accuracy):
            assert x == pytest.approx(y, rel=1e-5, abs=1e-6)
        assert ga.keys() == gb.keys() and "layers.1.mlp.down_proj.weight" in ga
        for n in ga:
            torch.testing.assert_close(ga[n], gb[n], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="compile_ttt"):
        TrainConfig(target="t", prompts="p", out="o", compile_ttt=True, ttt_impl="padded")


def test_copyable_marks_tokens_a_context_lookup_predicts():
    s = TrainSequence("x", [5, 6, 7, 5, 6, 7, 5, 6, 9, 5, 6, 9], 0)
    #               positions: 0  1  2  3  4  5  6  7  8  9 10 11
    # (5,6)->7, (6,7)->5, (7,5)->6 seen at 2..4 predict positions 5..7; at 8 a 9 follows (5,6)
    # instead; then (5,6)->9 (the latest) predicts position 11.
    assert [p for p, c in enumerate(s.copyable()) if c] == [5, 6, 7, 11]
    assert s.copyable() is s.copyable()  # cached


def test_copy_weight_reweights_the_loss_and_novel_accuracy_is_reported(target_and_head):
    target, path = target_and_head
    seqs = _seqs([40, 33, 25], 6, seed=3)  # a 6-token vocabulary: many copyable positions
    batch = collate_packed(seqs, 128, "cpu")
    draft = load_draft(path, target, torch.float32, "cpu")
    feats = TargetFeaturizer(target, draft.aux_layer_ids, torch.arange(48))
    aux, final = feats.packed(batch)
    with torch.no_grad():
        out = {w: packed_ttt_loss(draft, batch, aux, final, feats.head, 2, 0.8, copy_weight=w)
               for w in (1.0, 0.0)}
    a, b = out[1.0], out[0.0]
    assert 0 < a.step_counts_novel[0] < a.step_counts[0]
    assert a.step_losses == b.step_losses  # the logged per-step CE is the plain mean
    assert a.step_accuracy_novel == b.step_accuracy_novel
    assert not torch.allclose(a.loss, b.loss)  # weight 0: only the novel rows count
    with torch.no_grad():  # sharper labels: another loss, the same argmax hits
        c = packed_ttt_loss(draft, batch, aux, final, feats.head, 2, 0.8, label_temperature=0.5)
    assert not torch.allclose(a.loss, c.loss) and a.step_accuracy == c.step_accuracy
    with pytest.raises(ValueError, match="copy_weight"):
        from compiled_spec.train.trainer import TrainConfig
        TrainConfig(target="t", prompts="p", out="o", copy_weight=0.5, ttt_impl="padded")


def test_tail_weight_zero_trains_only_each_replys_head(target_and_head):
    """--tail-after N --tail-weight 0: the loss is the loss with every reply cut to its first N
    tokens (the tail's rows weigh nothing, the rest keep their relative weights); weights in
    between move it; the logged per-step CE stays the plain mean."""
    import dataclasses

    target, path = target_and_head
    seqs = _seqs([40, 33, 25], 48, seed=4)
    batch = collate_packed(seqs, 128, "cpu", tail_after=5)
    # reply spans of _seqs: (1, 4) + (6, n) or (2, n): tails begin 5 tokens into each span
    expect = torch.zeros(128, dtype=torch.bool)
    at = 0
    for sq in seqs:
        for a, b in sq.loss_spans():
            expect[at + min(a + 5, b):at + b] = True
        at += len(sq.input_ids)
    assert torch.equal(batch.tail, expect) and batch.tail.sum() > 40
    assert not collate_packed(seqs, 128, "cpu").tail.any()
    cut = dataclasses.replace(batch, loss_mask=batch.loss_mask & ~batch.tail)
    draft = load_draft(path, target, torch.float32, "cpu")
    feats = TargetFeaturizer(target, draft.aux_layer_ids, torch.arange(48))
    aux, final = feats.packed(batch)

    def loss(b, **kw):
        with torch.no_grad():
            return packed_ttt_loss(draft, b, aux, final, feats.head, 3, 0.8, copy_weight=0.5, **kw)

    zero, ref, half = loss(batch, tail_weight=0.0), loss(cut), loss(batch, tail_weight=0.5)
    torch.testing.assert_close(zero.loss, ref.loss, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(half.loss, ref.loss)
    assert half.step_losses == loss(batch).step_losses
    from compiled_spec.train.trainer import TrainConfig
    with pytest.raises(ValueError, match="tail_weight"):
        TrainConfig(target="t", prompts="p", out="o", tail_weight=0.5)  # no tail_after
    with pytest.raises(ValueError, match="tail_after"):
        TrainConfig(target="t", prompts="p", out="o", tail_after=0, tail_weight=0.5)


def test_compiled_feature_forward_equals_eager(target_and_head):
    """--compile-features: the target's forward through torch.compile (our backend, Inductor's
    C++ code here) gives the eager features, across batches of different token counts (dynamic
    shapes, no recompile per batch)."""
    target, path = target_and_head
    draft = load_draft(path, target, torch.float32, "cpu")
    eager = TargetFeaturizer(target, draft.aux_layer_ids, torch.arange(48))
    comp = TargetFeaturizer(target, draft.aux_layer_ids, torch.arange(48), compiled=True)
    for lengths in ([13, 7, 20], [31, 2, 9, 40]):
        batch = collate_packed(_seqs(lengths, 48), 128, "cpu")
        for a, b in zip(eager.packed(batch), comp.packed(batch)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_deeper_head_grows_from_a_shallower_one_drafting_the_same(tmp_path):
    """--num-layers 2 --init-from a 1-layer head: the added layer starts as an identity block
    (zero output projections), so the grown head's outputs equal the saved head's; without
    growing, the missing layer is an error."""
    from compiled_spec.train.checkpoint import load_head_into
    from compiled_spec.train.trainer import TrainConfig, build_head

    write_bigram_target(tmp_path / "t", vocab=48, hidden=32, layers=4, seed=3)
    target, tcfg = load_model(str(tmp_path / "t"), torch.float32, "cpu")
    path = write_eagle3_head(str(tmp_path / "h1"), tcfg, num_layers=1, draft_vocab_size=48,
                             aux_layer_ids=(0, 2, 4), seed=2)
    one = load_draft(path, target, torch.float32, "cpu")
    cfg = TrainConfig(target="t", prompts="p", out="o", num_layers=2, aux_layer_ids=(0, 2, 4))
    grown = build_head(target, cfg, torch.arange(48))
    with pytest.raises(ValueError, match="lacks"):
        load_head_into(grown, Path(path))
    load_head_into(grown, Path(path), grow=True)
    assert grown.layers[1].self_attn.o_proj.weight.abs().sum() == 0
    assert grown.layers[1].self_attn.q_proj.weight.abs().sum() > 0  # trainable, not zeroed
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 48, (2, 7), generator=g)
    hidden = torch.randn(2, 7, 32, generator=g)
    pos = torch.arange(7).expand(2, 7)
    # Saved in the HF layout (``layers.N.`` keys for a deeper head) and read back by the
    # engine's loader, it still drafts as the 1-layer head.
    from compiled_spec.train.checkpoint import save_head
    from compiled_spec.train.vocab import vocab_maps

    save_head(grown, vocab_maps(torch.arange(48), 48)[1], tmp_path / "h2")
    reloaded = load_draft(str(tmp_path / "h2"), target, torch.float32, "cpu")
    assert len(reloaded.layers) == 2
    with torch.no_grad():
        outs = (m.forward_dense(ids, hidden, pos) for m in (one, grown, reloaded))
        for a, b, c in zip(*outs):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
