"""Model configuration: the handful of hyper-parameters our decoder needs, validated up front.

Parsed from a Hugging Face ``config.json`` dict (old ``rope_theta``/``rope_scaling`` keys and
transformers 5's ``rope_parameters`` both work) or built by the GGUF loader from its metadata.
Anything our decoder would silently compute wrongly (sliding windows, other rope types, MLP bias,
non-SiLU activations) is rejected here with an error that names the offending value.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")

# HF `architectures` entries we can run, mapped to our architecture names.
_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 frequency scaling: long wavelengths are divided by ``factor``, short ones kept,
    and the band in between is interpolated smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"llama3 rope_scaling factor must be > 0, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "llama3 rope_scaling original_max_position_embeddings must be > 0, got "
                f"{self.original_max_position_embeddings}"
            )


@dataclass
class ModelConfig:
    architecture: str  # 'llama' | 'qwen2' | 'qwen3' | 'mistral'
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Llama3RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always True for qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before rope (qwen3)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    o_proj_bias: bool = False  # llama/qwen3 `attention_bias` also biases o_proj; qwen2 never does

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; expected one of "
                f"{SUPPORTED_ARCHITECTURES}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            # neox-style rope rotates the two halves of each head against each other.
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise ValueError(f"rope_scaling must be None or Llama3RopeScaling, got "
                             f"{type(self.rope_scaling).__name__}")
        self.eos_token_ids = [int(t) for t in self.eos_token_ids]
        for tok in ([self.bos_token_id] if self.bos_token_id is not None else []) + \
                self.eos_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"special token id {tok} outside vocab of {self.vocab_size}")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed Hugging Face ``config.json``."""
        arch = _architecture_from_hf(d)
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d.get('hidden_act')!r}; only 'silu'")
        if d.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"partial_rotary_factor {d['partial_rotary_factor']} is not supported")

        hidden = _req(d, "hidden_size")
        heads = _req(d, "num_attention_heads")
        max_pos = int(d.get("max_position_embeddings", 2048))
        _check_sliding_window(arch, d, max_pos)
        rope_theta, rope_scaling = _rope_from_hf(d)
        if not d.get("head_dim") and hidden % heads != 0:
            raise ValueError(f"hidden_size ({hidden}) is not divisible by num_attention_heads "
                             f"({heads}) and config.json gives no head_dim")

        attn_bias_flag = bool(d.get("attention_bias", False))
        if arch == "qwen2":
            # Qwen2 hard-codes q/k/v bias and never biases o_proj, whatever the config says.
            qkv_bias, o_bias = True, False
        elif arch == "mistral":
            qkv_bias, o_bias = False, False
        else:
            qkv_bias = o_bias = attn_bias_flag

        eos = d.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=_req(d, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_req(d, "intermediate_size"),
            num_hidden_layers=_req(d, "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or hidden // heads,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            qk_norm=arch == "qwen3",
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            o_proj_bias=o_bias,
        )


def _req(d: dict[str, Any], key: str) -> Any:
    if key not in d:
        raise ValueError(f"config is missing required key {key!r}")
    return d[key]


def _architecture_from_hf(d: dict[str, Any]) -> str:
    archs = d.get("architectures") or []
    if archs:
        for a in archs:
            if a in _HF_ARCHITECTURES:
                return _HF_ARCHITECTURES[a]
        raise ValueError(
            f"unsupported architecture {archs[0]!r}; supported: {sorted(_HF_ARCHITECTURES)}"
        )
    model_type = d.get("model_type")
    if model_type in SUPPORTED_ARCHITECTURES:
        return model_type
    raise ValueError(
        f"unsupported architecture (model_type={model_type!r}, no known 'architectures'); "
        f"supported: {sorted(_HF_ARCHITECTURES)}"
    )


def _check_sliding_window(arch: str, d: dict[str, Any], max_pos: int) -> None:
    # Our paged attention is always full causal attention; a window shorter than the context
    # would change results silently, so refuse it rather than approximate.
    window = d.get("sliding_window")
    if arch == "mistral":
        active = window is not None
    else:  # qwen2/qwen3 carry a sliding_window value that only applies with use_sliding_window
        active = bool(d.get("use_sliding_window", False)) and window is not None
    if active and window < max_pos:
        raise ValueError(
            f"sliding_window={window} < max_position_embeddings={max_pos} is not supported "
            "(only full attention is implemented)"
        )


def _rope_from_hf(d: dict[str, Any]) -> tuple[float, Llama3RopeScaling | None]:
    """Read rope theta/scaling from either transformers 5's ``rope_parameters`` or the older
    top-level ``rope_theta`` + ``rope_scaling`` keys."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    scaling = dict(params) if isinstance(params, dict) else dict(d.get("rope_scaling") or {})
    theta = float(scaling.get("rope_theta", d.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: 'default', 'llama3'")
    try:
        return theta, Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ValueError(f"llama3 rope scaling is missing key {e.args[0]!r}") from None
