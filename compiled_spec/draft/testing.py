"""Write tiny random EAGLE heads in the exact published key layouts, for tests.

The configs mirror public checkpoints (``yuhuili/EAGLE-LLaMA3-Instruct-8B`` style for EAGLE-1,
SpecForge/``yuhuili/EAGLE3-*`` style for EAGLE-3); the weights are random but scaled so activations
stay O(1): linears ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norms ~ 1 + 0.1 N(0, 1) (not exactly
one, so a misplaced norm is visible).
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import save_file

from compiled_spec.models.config import ModelConfig


def _llama_config(target: ModelConfig, num_layers: int, architecture: str) -> dict[str, Any]:
    scaling = target.rope_scaling
    return {
        "architectures": [architecture], "model_type": "llama",
        "bos_token_id": target.bos_token_id,
        "eos_token_id": target.eos_token_ids[0] if target.eos_token_ids else None,
        "hidden_act": "silu", "hidden_size": target.hidden_size, "initializer_range": 0.02,
        "intermediate_size": target.intermediate_size, "max_position_embeddings": 2048,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
        "num_hidden_layers": num_layers, "pretraining_tp": 1, "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": None if scaling is None else {
            "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings},
        "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": True,
        "vocab_size": target.vocab_size,
    }


class _Init:
    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def linear(self, out_f: int, in_f: int) -> torch.Tensor:  # [out, in]
        return torch.randn(out_f, in_f, generator=self.g) / in_f ** 0.5

    def norm(self, dim: int) -> torch.Tensor:  # [dim]
        return 1.0 + 0.1 * torch.randn(dim, generator=self.g)

    def embed(self, rows: int, dim: int) -> torch.Tensor:  # [rows, dim]
        return torch.randn(rows, dim, generator=self.g)


def _layer(init: _Init, t: ModelConfig, prefix: str, in_f: int, input_norm: bool,
           hidden_norm: bool) -> dict[str, torch.Tensor]:
    h, i = t.hidden_size, t.intermediate_size
    sd = {
        f"{prefix}self_attn.q_proj.weight": init.linear(t.q_size, in_f),
        f"{prefix}self_attn.k_proj.weight": init.linear(t.kv_size, in_f),
        f"{prefix}self_attn.v_proj.weight": init.linear(t.kv_size, in_f),
        f"{prefix}self_attn.o_proj.weight": init.linear(h, t.q_size),
        f"{prefix}mlp.gate_proj.weight": init.linear(i, h),
        f"{prefix}mlp.up_proj.weight": init.linear(i, h),
        f"{prefix}mlp.down_proj.weight": init.linear(h, i),
        f"{prefix}post_attention_layernorm.weight": init.norm(h),
    }
    if input_norm:
        sd[f"{prefix}input_layernorm.weight"] = init.norm(h)
    if hidden_norm:
        sd[f"{prefix}hidden_norm.weight"] = init.norm(h)
    return sd


def _write(directory: str, config: dict[str, Any], sd: dict[str, torch.Tensor]) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in sd.items()},
              os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


def write_eagle1_head(directory: str, target_config: ModelConfig, num_layers: int = 1,
                      with_embed: bool = False, seed: int = 0, bias: bool = False) -> str:
    """EAGLE-1: fc [h, 2h] (+ fc.bias when ``bias``), layers.0 without input_layernorm, later
    layers standard; optional embed_tokens; no norm / lm_head. Returns ``directory``."""
    t, init = target_config, _Init(seed)
    h = t.hidden_size
    sd = {"fc.weight": init.linear(h, 2 * h)}
    if bias:
        sd["fc.bias"] = 0.1 * torch.randn(h, generator=init.g)
    for i in range(num_layers):
        sd.update(_layer(init, t, f"layers.{i}.", h, input_norm=i > 0, hidden_norm=False))
    if with_embed:
        sd["embed_tokens.weight"] = init.embed(t.vocab_size, h)
    config = _llama_config(t, num_layers, "LlamaForCausalLM")
    config["bias"] = bias
    return _write(directory, config, sd)


def write_eagle3_head(directory: str, target_config: ModelConfig, num_layers: int = 1,
                      draft_vocab_size: int | None = None, use_midlayer_prefix: bool = True,
                      aux_layer_ids: tuple[int, ...] | None = None, seed: int = 0,
                      with_embed: bool = False,
                      architecture: str = "LlamaForCausalLMEagle3") -> str:
    """EAGLE-3: fc [h, 3h], layer 0 (``midlayer.`` or ``layers.0.``) with 2h-wide q/k/v and
    hidden_norm, later ``layers.i.`` standard, norm, lm_head [draft_vocab, h], d2t (offsets of a
    sorted random subset of target ids) and t2d (bool mask). ``draft_vocab_size`` defaults to half
    the target vocab. ``aux_layer_ids`` are written to ``eagle_config`` when given."""
    t, init = target_config, _Init(seed)
    h, vocab = t.hidden_size, t.vocab_size
    draft_vocab = draft_vocab_size or max(1, vocab // 2)
    sd = {"fc.weight": init.linear(h, 3 * h)}
    for i in range(num_layers):
        prefix = "midlayer." if i == 0 and use_midlayer_prefix else f"layers.{i}."
        sd.update(_layer(init, t, prefix, 2 * h if i == 0 else h, input_norm=True,
                         hidden_norm=i == 0))
    target_ids = torch.randperm(vocab, generator=init.g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    sd.update({"norm.weight": init.norm(h), "lm_head.weight": init.linear(draft_vocab, h),
               "d2t": target_ids - torch.arange(draft_vocab), "t2d": t2d})
    if with_embed:
        sd["embed_tokens.weight"] = init.embed(vocab, h)
    config = _llama_config(t, num_layers, architecture)
    config.update(draft_vocab_size=draft_vocab, target_hidden_size=h)
    if aux_layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
                                  "use_aux_hidden_state": True}
    return _write(directory, config, sd)
