"""Shard a loaded ``CausalLM`` for one tensor-parallel rank, in place.

Attention: q/k/v column parallel by heads (each rank keeps num_heads/tp query heads and
num_kv_heads/tp KV heads, so its KV cache holds only those), o_proj row parallel. MLP: gate/up
column parallel, down row parallel. Embedding and lm_head vocabulary parallel (one shard when
tied). Norms and rope are replicated. ``shard_draft`` does the same to an EAGLE head (optional:
a small draft may run faster replicated, with no collectives of its own). Loading then slicing costs one full copy of the weights
per rank while loading; fine for the models this serves, not for ones that only fit sharded.
"""
from __future__ import annotations

from compiled_spec.distributed.group import TPGroup
from compiled_spec.distributed.layers import (ColumnParallelLinear, ParallelLMHead,
                                              RowParallelLinear, VocabParallelEmbedding)
from compiled_spec.draft.model import EagleDraft
from compiled_spec.models.config import ModelConfig
from compiled_spec.models.decoder import CausalLM


def _shard_layers(layers: list, tp: TPGroup) -> None:
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        a.q_proj = ColumnParallelLinear(a.q_proj, tp, "q_proj out_features")
        a.k_proj = ColumnParallelLinear(a.k_proj, tp, "k_proj out_features")
        a.v_proj = ColumnParallelLinear(a.v_proj, tp, "v_proj out_features")
        a.o_proj = RowParallelLinear(a.o_proj, tp, "o_proj in_features")
        a.num_heads //= tp.world_size
        a.num_kv_heads //= tp.world_size
        m.gate_proj = ColumnParallelLinear(m.gate_proj, tp, "intermediate_size")
        m.up_proj = ColumnParallelLinear(m.up_proj, tp, "intermediate_size")
        m.down_proj = RowParallelLinear(m.down_proj, tp, "intermediate_size")


def check_tp_shapes(cfg: ModelConfig, world_size: int) -> None:
    """Refuse a model whose heads / MLP / vocabulary do not split over ``world_size`` ranks;
    called before any worker is started (they would each fail the same way, later)."""
    if world_size == 1:
        return
    tp = TPGroup(0, world_size)
    for n, what in ((cfg.num_attention_heads, "num_attention_heads"),
                    (cfg.num_key_value_heads, "num_key_value_heads"),
                    (cfg.intermediate_size, "intermediate_size"), (cfg.vocab_size, "vocab_size")):
        tp.split(n, what)


def shard_causal_lm(model: CausalLM, tp: TPGroup) -> CausalLM:
    cfg = model.config
    if tp.world_size == 1:
        return model
    tp.split(cfg.num_attention_heads, "num_attention_heads")
    tp.split(cfg.num_key_value_heads, "num_key_value_heads")
    _shard_layers(model.model.layers, tp)
    emb = VocabParallelEmbedding(model.model.embed_tokens, tp)
    model.model.embed_tokens = emb
    if cfg.tie_word_embeddings:
        model.lm_head = ParallelLMHead(emb.weight, tp)
    else:
        n = tp.split(cfg.vocab_size, "vocab_size")
        model.lm_head = ParallelLMHead(model.lm_head.weight[tp.rank * n:(tp.rank + 1) * n], tp)
    model.tp = tp
    return model


def shard_draft(draft: EagleDraft, tp: TPGroup) -> EagleDraft:
    """The draft's layers as the target's (heads and MLP split, KV cache per rank); fc stays
    replicated (its inputs, the target's aux states, and its output, the residual stream, are
    replicated); EAGLE-3's lm_head is vocabulary parallel over the draft vocabulary (EAGLE-1
    already uses the target's). Embeddings come from the target (sharded there) or, for a head
    with its own table, stay replicated."""
    cfg = draft.config
    if tp.world_size == 1:
        return draft
    tp.split(cfg.num_attention_heads, "draft num_attention_heads")
    tp.split(cfg.num_key_value_heads, "draft num_key_value_heads")
    _shard_layers(draft.layers, tp)
    if cfg.method == "eagle3":
        n = tp.split(cfg.draft_vocab_size, "draft_vocab_size")
        draft.lm_head = ParallelLMHead(draft.lm_head.weight[tp.rank * n:(tp.rank + 1) * n], tp)
    draft.tp = tp
    return draft
