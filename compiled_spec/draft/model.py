"""EAGLE-1 / EAGLE-3 draft heads over a flat token batch and their own paged KV caches.

Parameter names equal the public checkpoint keys (EAGLE-3's ``midlayer.`` is loaded as
``layers.0.``). The draft reuses the target's Attention / GatedMLP / RMSNorm / rope modules; every
draft layer owns a KV cache and receives its own ``AttentionMetadata`` (``attn_metas`` keyed by
``"layers.i"``), so the engine may lay out each layer's cache differently. No global state.

Data flow (h = draft hidden, see docs/eagle-reference.md):
  EAGLE-1: x = fc(cat(embed(ids), hidden)); layer 0 has no input norm (residual = x); later layers
           are Llama layers. feed_back = for_logits = x; logits = target lm_head(x).
  EAGLE-3: layer 0 attends over cat(input_layernorm(embed(ids)), hidden_norm(hidden)) (2h -> h)
           with residual = hidden; later layers are Llama layers. feed_back = x (pre-norm),
           for_logits = norm(x); logits = own reduced-vocab lm_head, mapped through d2t.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.draft.config import DraftConfig
from compiled_spec.models.decoder import Attention, CausalLM
from compiled_spec.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rope


class _TargetRef:
    """Holds the target outside nn.Module bookkeeping: the draft's state_dict, parameters and
    ``.to()`` stay draft-only while embedding / lm_head can still be shared."""

    __slots__ = ("model",)

    def __init__(self, model: CausalLM) -> None:
        self.model = model


class DraftLayer(nn.Module):
    def __init__(self, config: DraftConfig, idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.eagle3_first = config.method == "eagle3" and idx == 0
        self.eagle1_first = config.method == "eagle" and idx == 0
        self.norm_before_residual = config.norm_before_residual
        lc = config.layer_config()
        self.self_attn = Attention(lc, idx, in_features=2 * h if self.eagle3_first else h)
        self.mlp = GatedMLP(h, config.intermediate_size)
        if not self.eagle1_first:  # EAGLE-1's first layer feeds fc's output in un-normed
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        if self.eagle3_first:
            self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)

    def attn_input(self, x: torch.Tensor,  # [..., h] stream entering the layer
                   embeds: torch.Tensor,  # [..., h] token embeddings (used by EAGLE-3 layer 0)
                   ) -> tuple[torch.Tensor, torch.Tensor]:  # ([..., in_features], [..., h])
        if self.eagle3_first:
            normed = self.hidden_norm(x)
            residual = normed if self.norm_before_residual else x
            return torch.cat((self.input_layernorm(embeds), normed), dim=-1), residual
        if self.eagle1_first:
            return x, x
        return self.input_layernorm(x), x

    def finish(self, attn_out: torch.Tensor,  # [..., h]
               residual: torch.Tensor) -> torch.Tensor:  # [..., h]
        x = residual + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


def project_qkv(attn: Attention, x: torch.Tensor,  # [B, S, in_features]
                cos: torch.Tensor, sin: torch.Tensor,  # [B*S, head_dim]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The paged Attention's q/k/v projections, q/k norms and rope on a dense [B, S] batch
    (training paths): q [B, heads, S, head_dim], k and v [B, kv_heads, S, head_dim]."""
    b, s, _ = x.shape
    flat = x.reshape(b * s, -1)
    q = attn.q_proj(flat).view(b * s, attn.num_heads, attn.head_dim)
    k = attn.k_proj(flat).view(b * s, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(flat).view(b * s, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = apply_rope(q, cos, sin).view(b, s, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = apply_rope(k, cos, sin).view(b, s, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = v.view(b, s, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    return q, k, v


def dense_attention(attn: Attention, x: torch.Tensor,  # [B, S, in_features]
                    cos: torch.Tensor, sin: torch.Tensor,  # [B*S, head_dim]
                    ) -> torch.Tensor:  # [B, S, h]
    """The paged Attention's math with causal SDPA and no KV cache (training mode); rows are
    whole sequences starting at their first token."""
    b, s, _ = x.shape
    q, k, v = project_qkv(attn, x, cos, sin)
    # GQA: query head j reads kv head j // group, as in the paged kernels.
    group = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(b, s, attn.num_heads * attn.head_dim))


class EagleDraft(nn.Module):
    def __init__(self, config: DraftConfig, target: CausalLM, own_embedding: bool = False) -> None:
        super().__init__()
        self.config = config
        self._target = _TargetRef(target)
        tcfg = target.config
        h = config.hidden_size
        if not own_embedding and h != tcfg.hidden_size:
            raise ValueError(f"draft hidden size {h} != target hidden size {tcfg.hidden_size}: "
                             "a head without embed_tokens must share the target's embedding")
        self.own_embedding = own_embedding
        if own_embedding:  # input ids are target ids, so the table has target-vocab rows
            self.embed_tokens = nn.Embedding(tcfg.vocab_size, h)
        self.fc = nn.Linear(config.fc_in_features, h, bias=config.bias)
        self.layers = nn.ModuleList([DraftLayer(config, i)
                                     for i in range(config.num_hidden_layers)])
        if config.method == "eagle3":
            self.norm = RMSNorm(h, config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
            # target_id = draft_id + d2t[draft_id]; zeros (identity) when the checkpoint omits it.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        # Rope frequencies do not depend on the table length; cover the target's context too, since
        # heads often declare a short max_position_embeddings (2048) yet run at any position.
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, max(config.max_position_embeddings, tcfg.max_position_embeddings),
            config.rope_theta, config.rope_scaling)

    @property
    def target(self) -> CausalLM:
        return self._target.model

    @property
    def layer_names(self) -> list[str]:
        """Keys ``forward`` expects in ``attn_metas``: ``["layers.0", "layers.1", ...]``."""
        return self.config.layer_names

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """Pass to the target's forward (EAGLE-3); empty for EAGLE-1 (uses its final hidden)."""
        return self.config.aux_layer_ids

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One (k_cache, v_cache) pair per draft layer, each
        ``[num_blocks, page_size, num_kv_heads, head_dim]``; bind after moving/casting."""
        cfg = self.config
        if len(caches) != cfg.num_hidden_layers:
            raise ValueError(f"expected {cfg.num_hidden_layers} draft (k, v) cache pairs, "
                             f"got {len(caches)}")
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, caches)):
            want = (layer.self_attn.num_kv_heads, cfg.head_dim)  # this rank's heads when sharded
            if k_cache.dim() != 4 or tuple(k_cache.shape[2:]) != want or \
                    k_cache.shape != v_cache.shape:
                raise ValueError(f"draft layer {i}: k/v caches {tuple(k_cache.shape)} / "
                                 f"{tuple(v_cache.shape)}; expected two equal "
                                 f"[num_blocks, page_size, {want[0]}, {want[1]}]")
            layer.self_attn.k_cache = k_cache
            layer.self_attn.v_cache = v_cache

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., h]
        if self.own_embedding:
            return self.embed_tokens(input_ids)
        return self.target.embed(input_ids)

    def combine_aux(self, aux: list[torch.Tensor],
                    out: torch.Tensor | None = None) -> torch.Tensor:  # -> [T, h]
        """Target states -> the draft's incoming hidden. EAGLE-3: ``aux`` are the target's
        ``aux_layer_ids`` states, each [T, target_h] (or one [T, 3 * target_h], concatenated
        where a graph computed them), fused by fc; ``out`` [T, h]: the fc writes there (a
        graph's input buffer, so its replay copies nothing), by the GEMM ``nn.Linear`` runs.
        EAGLE-1: ``[final normed hidden]`` [T, h], returned unchanged (its fc runs inside
        forward, with the embedding)."""
        if self.config.method == "eagle3":
            n_aux = len(self.config.aux_layer_ids)
            if len(aux) == 1 and n_aux > 1:  # concatenated already (engine.graphs.with_logits)
                if aux[0].shape[-1] != self.fc.in_features:
                    raise ValueError(f"EAGLE-3 combine_aux expects concatenated aux states of "
                                     f"width {self.fc.in_features}, got {aux[0].shape[-1]}")
                x = aux[0]  # [T, 3*target_h]
            elif len(aux) != n_aux:
                raise ValueError(f"EAGLE-3 combine_aux expects {n_aux} aux hidden states (or "
                                 f"their concatenation), got {len(aux)}")
            else:
                x = torch.cat(aux, dim=-1)  # [T, 3*target_h]
            if out is None or x.dim() != 2 or (torch.is_grad_enabled()
                                               and self.fc.weight.requires_grad):
                return self.fc(x)  # -> [T, h] (out= has no autograd: training takes this)
            # nn.Linear of a 2-D input is addmm with a bias, else mm: the same kernels, out=
            w = self.fc.weight.t()
            if self.fc.bias is not None:
                return torch.addmm(self.fc.bias, x, w, out=out)
            return torch.mm(x, w, out=out)
        if len(aux) != 1:
            raise ValueError(f"EAGLE-1 combine_aux expects [final hidden], got {len(aux)} tensors")
        return aux[0]

    def _prologue(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # [..., h]
        if self.config.method == "eagle":
            return self.fc(torch.cat((embeds, hidden), dim=-1))  # [..., 2h] -> [..., h]
        return hidden  # EAGLE-3 layer 0 consumes embeds and hidden itself

    def _outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.config.method == "eagle3":
            return x, self.norm(x)
        return x, x

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64 target token ids
        hidden: torch.Tensor,  # [T, h] from combine_aux, or the previous step's feed_back
        positions: torch.Tensor,  # [T] int64
        attn_metas: dict[str, AttentionMetadata],  # per layer: "layers.0", "layers.1", ...
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (feed_back [T, h], for_logits [T, h])
        embeds = self.embed(input_ids)  # [T, h]
        cos, sin = self.rotary_emb(positions, embeds.dtype)  # [T, head_dim] each
        x = self._prologue(embeds, hidden)
        for i, layer in enumerate(self.layers):
            name = f"layers.{i}"
            if name not in attn_metas:
                raise ValueError(f"attn_metas has no entry for draft layer {name!r} (got keys "
                                 f"{sorted(attn_metas)}); pass one AttentionMetadata per layer")
            attn_in, residual = layer.attn_input(x, embeds)
            x = layer.finish(layer.self_attn(attn_in, cos, sin, attn_metas[name]), residual)
        return self._outputs(x)

    def forward_from_aux(self, aux: list[torch.Tensor],  # each [T, target_h]
                         input_ids: torch.Tensor, positions: torch.Tensor,
                         attn_metas: dict[str, AttentionMetadata]) -> tuple[torch.Tensor, torch.Tensor]:
        """The first draft pass straight from the target's states: combine_aux then forward. Kept
        as one function so the compiler sees the fc in the graph (and hoists it to eager)."""
        return self(input_ids, self.combine_aux(aux), positions, attn_metas)

    def forward_dense(
        self,
        input_ids: torch.Tensor,  # [B, S] int64
        hidden: torch.Tensor,  # [B, S, h]
        positions: torch.Tensor,  # [B, S] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (feed_back [B, S, h], for_logits [B, S, h])
        """Training-mode forward: same function as ``forward``, causal SDPA, no KV cache."""
        embeds = self.embed(input_ids)  # [B, S, h]
        cos, sin = self.rotary_emb(positions.reshape(-1), embeds.dtype)  # [B*S, head_dim]
        x = self._prologue(embeds, hidden)
        for layer in self.layers:
            attn_in, residual = layer.attn_input(x, embeds)
            x = layer.finish(dense_attention(layer.self_attn, attn_in, cos, sin), residual)
        return self._outputs(x)

    def compute_logits(self, for_logits: torch.Tensor,  # [N, h] -> [N, V_draft]
                       fp32: bool = True) -> torch.Tensor:
        """fp32 for sampling, as the target does; ``fp32=False``: an EAGLE-3 head's in the model
        dtype, for the tree's top-k, which converts as it loads (no [N, V] fp32 copy: a
        kernel per expansion on the H100)."""
        if self.config.method == "eagle3":
            logits = self.lm_head(for_logits)
            return logits.float() if fp32 else logits
        return self.target.compute_logits(for_logits)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:  # [...] -> [...]
        if self.config.method == "eagle3":
            return draft_ids + self.d2t[draft_ids]
        return draft_ids

    def draft_vocab_to_target_probs(self, probs: torch.Tensor,  # [N, V_draft]
                                    target_vocab: int) -> torch.Tensor:  # [N, target_vocab]
        """Spread draft-vocab probabilities onto the target vocab (zeros elsewhere), so they can
        be compared with target probabilities in rejection sampling."""
        if probs.shape[-1] != self.config.draft_vocab_size:
            raise ValueError(f"probs width {probs.shape[-1]} != draft vocab "
                             f"{self.config.draft_vocab_size}")
        if self.config.method == "eagle":
            if target_vocab != probs.shape[-1]:
                raise ValueError(f"EAGLE-1 draft vocab {probs.shape[-1]} != target vocab "
                                 f"{target_vocab}")
            return probs
        idx = self.draft_to_target(torch.arange(probs.shape[-1], device=probs.device))
        return probs.new_zeros(probs.shape[0], target_vocab).index_copy_(1, idx, probs)
