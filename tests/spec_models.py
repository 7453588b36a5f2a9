"""Tiny target / draft pairs with known behaviour, written as real checkpoints.

``write_bigram_target``: a Llama whose attention outputs are zeroed (o_proj = 0), so its next-token
distribution depends on the current token only. Its final norm has unit weights, which makes the
target's argmax that of lm_head(f(t)) for the residual stream f(t).

``write_mirror_eagle1``: an EAGLE-1 head (published layout) that recomputes f(t) for the token it
is fed: fc = [I | 0] takes the token embedding, attention is zeroed, and its layers carry the
target's MLPs and post-attention norms. Its logits (target lm_head on f(t), no norm) have the
target's argmax, so greedy drafts are always accepted. ``noise`` perturbs the copied MLPs so
that only some drafts agree.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_bigram_target(d: Path, vocab: int = 32, hidden: int = 32, layers: int = 2,
                        logit_scale: float = 1.0, seed: int = 0, attention: bool = False) -> str:
    """A tiny Llama whose next token depends only on the current one (attention output zeroed,
    so a head learns it in seconds). ``attention=True`` keeps o_proj random: the output then
    depends on the whole KV, which a test of anything that writes or moves KV needs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=vocab - 1)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
        for layer in m.model.layers:
            if not attention:
                layer.self_attn.o_proj.weight.zero_()
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        m.model.norm.weight.fill_(1.0)
        m.lm_head.weight.mul_(logit_scale)
    m.save_pretrained(d)
    return str(d)


def write_mirror_eagle1(d: Path, target_dir: str, noise: float = 0.0, seed: int = 1) -> str:
    from safetensors import safe_open

    d.mkdir(parents=True, exist_ok=True)
    tcfg = json.loads((Path(target_dir) / "config.json").read_text())
    with safe_open(str(Path(target_dir) / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    h = tcfg["hidden_size"]
    n_layers = tcfg["num_hidden_layers"]
    kv = tcfg["num_key_value_heads"] * (h // tcfg["num_attention_heads"])
    g = torch.Generator().manual_seed(seed)
    sd = {"fc.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)}
    for i in range(n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        sd[dst + "self_attn.q_proj.weight"] = torch.randn(h, h, generator=g) * 0.1
        sd[dst + "self_attn.k_proj.weight"] = torch.randn(kv, h, generator=g) * 0.1
        sd[dst + "self_attn.v_proj.weight"] = torch.randn(kv, h, generator=g) * 0.1
        sd[dst + "self_attn.o_proj.weight"] = torch.zeros(h, h)
        for name in ("gate_proj", "up_proj", "down_proj"):
            w = t[src + f"mlp.{name}.weight"].clone()
            sd[dst + f"mlp.{name}.weight"] = w + noise * torch.randn(w.shape, generator=g) * w.std()
        sd[dst + "post_attention_layernorm.weight"] = t[src + "post_attention_layernorm.weight"].clone()
        if i > 0:  # EAGLE-1's first layer has no input_layernorm
            sd[dst + "input_layernorm.weight"] = torch.ones(h)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))
    cfg = {k: tcfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                                "max_position_embeddings", "bos_token_id", "eos_token_id")}
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=n_layers,
               rope_theta=10000.0, hidden_act="silu", bias=False)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(d)


def write_id_prompts(path: Path, n: int, vocab: int, seed: int = 0) -> str:
    """A JSONL prompt file of token-id prompts (a tiny vocabulary is not a text vocabulary)."""
    import random

    rng = random.Random(seed)
    with Path(path).open("w") as f:
        for i in range(n):
            ids = [rng.randrange(vocab - 1) for _ in range(rng.randint(1, 8))]
            f.write(json.dumps({"id": i, "source": "test", "prompt_ids": ids}) + "\n")
    return str(path)


def write_tiny_llama(d: Path, tokenizer, layers: int = 2, max_positions: int = 128,
                     seed: int = 0) -> str:
    """A random HF Llama over ``tokenizer``'s vocabulary, saved with the tokenizer. Its logits
    spread over several units (lm_head ~ N(0, 0.5)): greedy has clear winners (no float ties
    between batch shapes or engines) and T=1 sampling still picks among a handful of tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_positions, rope_theta=10000.0,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        m.lm_head.weight.normal_(0.0, 0.5)
    m.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return str(d)


def give_attention(llm, seed: int = 0, scale: float = 0.3) -> None:
    """Random o_proj weights in a loaded bigram target (whose attention is zeroed), so a wrong
    KV write or move, tree mask or padded row shows in its output."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in llm.engine.model.model.layers:
            w = layer.self_attn.o_proj.weight
            w.copy_(torch.randn(w.shape, generator=gen) * scale)
