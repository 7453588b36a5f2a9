"""Fused q/k/v and gate/up projections (compiled_spec.models.fuse): same logits as the separate
layers on every architecture the loader reads, no extra weight memory, checkpoint names still
readable, heads under training left alone, and the engine runs fused."""
from __future__ import annotations

import pytest
import torch

from compiled_spec.bench.timing import weight_bytes
from compiled_spec.draft.loader import load_draft
from compiled_spec.draft.testing import write_eagle3_head
from compiled_spec.models.decoder import Attention
from compiled_spec.models.fuse import fuse_projections
from compiled_spec.models.layers import GatedMLP
from compiled_spec.models.loader import load_model
from tests.test_models import run_paged, tiny_checkpoint  # noqa: F401  (fixture)

SEQS = [[3, 17, 5, 9, 22, 40, 1, 8, 13], [7, 7, 30, 2, 11]]
# Prefill chunks, decodes and a 4-token verify chunk in one batch, plus two padding rows.
SCHEDULE = [[4, 5], [3, 0], [1, 0], [1, 0]]


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_fused_forward_matches_separate(tiny_checkpoint) -> None:  # noqa: F811
    case, path, _ = tiny_checkpoint
    model, _ = load_model(path, torch.float32, "cpu")
    cfg = model.config
    aux = (0, cfg.num_hidden_layers)
    ref_logits, ref_aux = run_paged(model, SEQS, SCHEDULE, page_size=4, aux_layer_ids=aux,
                                    pad_tokens=2)
    q_before = model.model.layers[0].self_attn.q_proj.weight.clone()
    bytes_before = weight_bytes(model)  # each storage once

    assert fuse_projections(model) == 2 * cfg.num_hidden_layers
    assert fuse_projections(model) == 0  # idempotent
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    assert attn.qkv_proj.weight.shape == (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size)
    assert (attn.qkv_proj.bias is not None) == (attn.q_proj.bias is not None)
    # The separate layers are views into the fused weights: same values, no second copy.
    assert torch.equal(attn.q_proj.weight, q_before)
    assert _storage(attn.k_proj.weight) == _storage(attn.qkv_proj.weight)
    assert _storage(mlp.up_proj.weight) == _storage(mlp.gate_up_proj.weight)
    assert torch.equal(mlp.gate_up_proj.weight[cfg.intermediate_size:], mlp.up_proj.weight)
    # Fused parameters replace (not add to) the storage of the separate ones; this is also the
    # floor the benchmarks divide by.
    assert weight_bytes(model) == bytes_before

    logits, got_aux = run_paged(model, SEQS, SCHEDULE, page_size=4, aux_layer_ids=aux,
                                pad_tokens=2)
    for a, b in zip(logits, ref_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(got_aux, ref_aux):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_fused_forward_detects_a_wrong_split(tiny_checkpoint) -> None:  # noqa: F811
    """The check above can fail: swapping k and v rows inside the fused weight changes logits."""
    _, path, _ = tiny_checkpoint
    model, _ = load_model(path, torch.float32, "cpu")
    ref, _ = run_paged(model, SEQS, SCHEDULE, page_size=4)
    fuse_projections(model)
    attn = model.model.layers[0].self_attn
    q, kv = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    with torch.no_grad():
        w = attn.qkv_proj.weight
        w[q:q + 2 * kv] = torch.cat([w[q + kv:q + 2 * kv].clone(), w[q:q + kv].clone()])
    got, _ = run_paged(model, SEQS, SCHEDULE, page_size=4)
    assert not torch.allclose(got[0], ref[0], atol=1e-3)


def test_heads_in_training_are_not_fused(tmp_path, tiny_checkpoint) -> None:  # noqa: F811
    _, path, _ = tiny_checkpoint
    target, tcfg = load_model(path, torch.float32, "cpu")
    head = write_eagle3_head(str(tmp_path / "head"), tcfg, num_layers=2)
    draft = load_draft(head, target, torch.float32, "cpu")
    draft.requires_grad_(True)  # as the trainer holds it: views would detach it from AdamW
    assert fuse_projections(draft) == 0
    assert all(m.qkv_proj is None for m in draft.modules() if isinstance(m, Attention))
    draft.requires_grad_(False)
    assert fuse_projections(draft) == 2 * draft.config.num_hidden_layers
    assert all(m.gate_up_proj is not None for m in draft.modules() if isinstance(m, GatedMLP))


def test_engine_runs_fused(trained_eagle3_pair, smollm2_gguf_path) -> None:
    target, head = trained_eagle3_pair
    from compiled_spec import LLM, SamplingParams

    llm = LLM(model=target, tokenizer=smollm2_gguf_path, draft=head, method="eagle3",
              num_speculative_tokens=3, max_model_len=64)
    mods = list(llm.engine.model.modules()) + list(llm.engine.draft.modules())
    assert all(m.qkv_proj is not None for m in mods if isinstance(m, Attention))
    assert all(m.gate_up_proj is not None for m in mods if isinstance(m, GatedMLP))
    out = llm.generate([[3, 4, 5]],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
