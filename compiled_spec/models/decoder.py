"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3) over a flat token batch and a paged
KV cache.

Submodule names mirror Hugging Face checkpoints exactly, so a checkpoint's state dict loads with no
renaming. Tokens carry no batch dimension: prefill chunks, decode steps and multi-token
verification of several sequences share one forward, described by ``AttentionMetadata``.
Attention goes through ``torch.ops.compiled_spec.*`` so torch.compile sees opaque custom ops
(which the compiler passes look for) instead of tracing into the reference kernels.
"""
from __future__ import annotations

import os

import torch
from torch import nn

import kernels.ops  # noqa: F401  (registers torch.ops.compiled_spec.*)
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.models.config import ModelConfig
from compiled_spec.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope


# Rope folded into the KV write (compiled_spec::rope_write_kv) for fused q/k/v; 0 restores the
# separate rope and write_kv ops (read at import: it decides what torch.compile traces).
ROPE_KV = os.environ.get("COMPILED_SPEC_ROPE_KV", "1") != "0"


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, in_features: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim ** -0.5
        hidden = config.hidden_size
        # q/k/v may read a wider input than the residual stream (EAGLE-3's first draft layer
        # attends over cat(embedding, hidden), width 2h); o_proj always writes back `hidden`.
        in_features = hidden if in_features is None else in_features
        self.q_proj = nn.Linear(in_features, config.q_size, bias=config.attention_bias)
        self.k_proj = nn.Linear(in_features, config.kv_size, bias=config.attention_bias)
        self.v_proj = nn.Linear(in_features, config.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.q_size, hidden, bias=config.o_proj_bias)
        # Set by compiled_spec.models.fuse at inference: one GEMM for q, k and v (rows are
        # [q; k; v]); q_proj / k_proj / v_proj then hold views of its weight.
        self.qkv_proj: nn.Linear | None = None
        if config.qk_norm:
            # Qwen3 normalises each head over head_dim (not the whole projection) before rope.
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = None
            self.k_norm = None
        # The caches belong to the engine (allocated once, shared with CUDA graphs); the layer only
        # holds references. Non-persistent buffers: visible to torch.compile as module state but
        # never part of a checkpoint.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def _qkv(self, hidden: torch.Tensor,  # [T, in_features]
             cos: torch.Tensor, sin: torch.Tensor,  # [T, head_dim]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, heads, head_dim] and k, v [T, kv_heads, head_dim], q and k roped (and normed
        for Qwen3): unfused projections, or Qwen3's fused ones (fused q/k/v without norms go
        through ``_write_qkv``'s own path). The outputs may be strided views, which the
        attention and KV-write kernels read as they are."""
        num_tokens = hidden.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            # viewed whole, then sliced: see _write_qkv
            qkv = self.qkv_proj(hidden).view(num_tokens, h + 2 * kvh, d)
            q, k, v = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
        else:
            q = self.q_proj(hidden).view(num_tokens, h, d)
            k = self.k_proj(hidden).view(num_tokens, kvh, d)
            v = self.v_proj(hidden).view(num_tokens, kvh, d)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _write_qkv(self, hidden: torch.Tensor,  # [T, in_features]
                   cos: torch.Tensor, sin: torch.Tensor,  # [T, head_dim]
                   slot_mapping: torch.Tensor,  # [T]
                   ) -> torch.Tensor:  # [T, heads, head_dim] the roped queries
        """This step's roped keys and values into the cache (first, so each token attends to
        itself and to the other new tokens of its sequence through the cache, exactly like
        earlier context); returns the roped queries."""
        if self.qkv_proj is None or self.q_norm is not None:
            q, k, v = self._qkv(hidden, cos, sin)
            torch.ops.compiled_spec.write_kv(k, v, self.k_cache, self.v_cache, slot_mapping)
            return q
        num_tokens = hidden.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        # Viewed whole, then sliced (the same strides as slicing, then viewing): Inductor
        # lowers a view of a non-contiguous slice by asking whether T == 1, which specialized
        # batch 1's decode graph (1 token) and compiled the target a second time for every
        # other size (CompileConfig.size_oblivious; 27th session).
        qkv = self.qkv_proj(hidden).view(num_tokens, h + 2 * kvh, d)  # [T, heads + 2 kv, d]
        qk, v = qkv[:, :h + kvh], qkv[:, h + kvh:]
        if ROPE_KV:
            # Rope and the KV write as one op (one kernel on the GPU instead of Inductor's
            # rope and the write), which returns the roped queries.
            return torch.ops.compiled_spec.rope_write_kv(qk, v, self.k_cache, self.v_cache,
                                                         slot_mapping, cos, sin, h)
        qk = apply_rope(qk, cos, sin)  # q and k roped as one tensor: one elementwise kernel
        torch.ops.compiled_spec.write_kv(qk[:, h:], v, self.k_cache, self.v_cache, slot_mapping)
        return qk[:, :h]

    def forward(
        self,
        hidden: torch.Tensor,  # [T, in_features] (in_features == hidden except EAGLE-3 layer 0)
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        attn_meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: KV cache not bound; call CausalLM.bind_kv_cache() "
                "before forward"
            )
        num_tokens = hidden.shape[0]
        q = self._write_qkv(hidden, cos, sin, attn_meta.slot_mapping)  # [T, heads, head_dim]
        if attn_meta.tree_mask is not None:  # draft-tree nodes: ancestors-only attention
            out = torch.ops.compiled_spec.paged_tree_attention(
                q, self.k_cache, self.v_cache, attn_meta.block_tables, attn_meta.tree_start,
                attn_meta.seq_lens, attn_meta.tree_mask, attn_meta.query_start_loc,
                attn_meta.max_query_len, attn_meta.tree_mask.shape[1], attn_meta.max_seq_len,
                self.scale)
            return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))
        out = torch.ops.compiled_spec.paged_attention(
            q, self.k_cache, self.v_cache, attn_meta.block_tables, attn_meta.seq_lens,
            attn_meta.query_start_loc, attn_meta.max_query_len, attn_meta.max_seq_len,
            self.scale,
        )  # [T, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor,  # [T, hidden] residual stream entering the layer
                cos: torch.Tensor, sin: torch.Tensor,
                attn_meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, attn_meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    """The ``model.*`` part of an HF checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # One shared table for all layers (HF also keeps a single model.rotary_emb).
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # The lm_head through our skinny GEMM at decode sizes (``readout``): compile_models sets
        # it as CompileConfig.skinny_gemm_readout resolves (compiled_spec/gemm_policy.py)
        self.skinny_readout = False
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with lm_head when the config says so. Call again after
        anything that replaces Parameter objects (e.g. ``to_empty``)."""
        if self.config.tie_word_embeddings and getattr(self, "tp", None) is None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Point every attention layer at its (k_cache, v_cache) pair, each
        ``[num_blocks, page_size, num_kv_heads, head_dim]``. Bind after moving/casting the model:
        ``.to()`` would copy the bound caches instead of sharing the engine's tensors."""
        cfg = self.config
        if len(caches) != cfg.num_hidden_layers:
            raise ValueError(f"expected {cfg.num_hidden_layers} (k, v) cache pairs, "
                             f"got {len(caches)}")
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.model.layers, caches)):
            heads = layer.self_attn.num_kv_heads  # this rank's share under tensor parallelism
            for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                if cache.dim() != 4 or tuple(cache.shape[2:]) != (heads, cfg.head_dim):
                    raise ValueError(
                        f"layer {i} {name} has shape {tuple(cache.shape)}; expected "
                        f"[num_blocks, page_size, {heads}, {cfg.head_dim}]")
            if k_cache.shape != v_cache.shape:
                raise ValueError(f"layer {i}: k_cache {tuple(k_cache.shape)} and v_cache "
                                 f"{tuple(v_cache.shape)} differ")
            layer.self_attn.k_cache = k_cache
            layer.self_attn.v_cache = v_cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        attn_meta: AttentionMetadata,
        aux_layer_ids: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final hidden state after ``model.norm`` ``[T, hidden]`` and, per id in
        ``aux_layer_ids``, the residual stream entering that layer ``[T, hidden]`` (id ==
        num_hidden_layers: the stream after the last layer, before the final norm). EAGLE-3
        drafts from these."""
        num_layers = self.config.num_hidden_layers
        for idx in aux_layer_ids:
            if not 0 <= idx <= num_layers:
                raise ValueError(f"aux layer id {idx} outside [0, {num_layers}]")
        hidden = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.model.rotary_emb(positions, hidden.dtype)  # [T, head_dim] each
        # Slots filled by position rather than a dict keyed by layer id: under torch.compile with
        # dynamic=True the ids may arrive as SymInts, which cannot be dict keys.
        captured: list[torch.Tensor | None] = [None] * len(aux_layer_ids)
        for i, layer in enumerate(self.model.layers):
            self._capture(captured, aux_layer_ids, i, hidden)
            hidden = layer(hidden, cos, sin, attn_meta)
        self._capture(captured, aux_layer_ids, num_layers, hidden)
        return self.model.norm(hidden), captured  # type: ignore[return-value]

    @staticmethod
    def _capture(captured: list[torch.Tensor | None], aux_layer_ids: tuple[int, ...],
                 layer_idx: int, hidden: torch.Tensor) -> None:
        for j, idx in enumerate(aux_layer_ids):
            if idx == layer_idx:
                captured[j] = hidden

    def readout(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        """The lm_head in the model dtype. With ``skinny_readout``, rows up to the skinny
        kernels' limit go through our GEMM (the op falls back to the same matmul elsewhere):
        captured steps and eager ones read the same logits."""
        if self.skinny_readout:
            return torch.ops.compiled_spec.skinny_linear(hidden, self.lm_head.weight)
        return self.lm_head(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, vocab]
        # The matmul runs in the model dtype (an fp32 copy of lm_head would cost vocab*hidden
        # memory); the result is upcast so softmax/sampling/acceptance math downstream is fp32.
        return self.readout(hidden).float()
