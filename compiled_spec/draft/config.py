"""EAGLE draft-head configuration, read from a public checkpoint's ``config.json`` plus its tensor
names/shapes, and checked against the target it will draft for.

Formats (see docs/eagle-reference.md): EAGLE-1 heads take cat(token embedding, target final hidden)
through ``fc [h, 2h]``; EAGLE-3 heads take ``fc [h, 3*target_h]`` over three auxiliary target hidden
states and carry their own final norm, reduced-vocab ``lm_head`` and ``d2t`` map.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from compiled_spec.models.config import Llama3RopeScaling, ModelConfig

METHODS = ("eagle", "eagle3")
# Tensors only an EAGLE-3 head has (after renaming midlayer. -> layers.0.).
# config.json flag (ours): the head stores no lm_head; it is the target's lm_head at the draft
# vocabulary (a head trained with its readout frozen there), rebuilt at load from d2t.
LM_HEAD_FROM_TARGET = "lm_head_from_target"
_EAGLE3_ONLY = ("d2t", "t2d", "norm.weight", "lm_head.weight")


@dataclass
class DraftConfig:
    method: str  # 'eagle' (EAGLE-1) | 'eagle3'
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
    draft_vocab_size: int  # == target vocab for EAGLE-1
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...] = ()  # EAGLE-3 only: target layers whose input stream is used
    bias: bool = False  # EAGLE-1 fc bias
    target_vocab_size: int | None = None  # ids fed to the embedding and targets of d2t
    attention_bias: bool = False  # Llama attention_bias: q/k/v/o biases
    norm_before_residual: bool = False  # EAGLE-3 variant: residual = hidden_norm(hidden)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown draft method {self.method!r}; expected one of {METHODS}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "draft_vocab_size", "target_hidden_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"draft {name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(f"draft num_attention_heads ({self.num_attention_heads}) must be "
                             f"divisible by num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"draft head_dim must be even for rope, got {self.head_dim}")
        if not self.rms_norm_eps > 0 or not self.rope_theta > 0:
            raise ValueError(f"draft rms_norm_eps ({self.rms_norm_eps}) and rope_theta "
                             f"({self.rope_theta}) must be > 0")
        self.aux_layer_ids = tuple(int(i) for i in self.aux_layer_ids)
        if self.method == "eagle3":
            if not self.aux_layer_ids:
                raise ValueError("an EAGLE-3 draft needs aux_layer_ids (target layers to tap)")
            if self.bias:
                raise ValueError("bias=True (fc bias) is an EAGLE-1 option; EAGLE-3 fc has none")
        else:
            if self.aux_layer_ids:
                raise ValueError(f"EAGLE-1 drafts from the final hidden state; got "
                                 f"aux_layer_ids={self.aux_layer_ids}")
            if self.target_vocab_size is not None and self.draft_vocab_size != \
                    self.target_vocab_size:
                raise ValueError(f"EAGLE-1 draft vocab {self.draft_vocab_size} must equal the "
                                 f"target vocab {self.target_vocab_size}")
            if self.hidden_size != self.target_hidden_size:
                raise ValueError(f"EAGLE-1 draft hidden size {self.hidden_size} must equal the "
                                 f"target hidden size {self.target_hidden_size}")
        if self.target_vocab_size is not None and self.draft_vocab_size > self.target_vocab_size:
            raise ValueError(f"draft vocab {self.draft_vocab_size} exceeds target vocab "
                             f"{self.target_vocab_size}")

    # --- derived -------------------------------------------------------------------------------
    @property
    def fc_in_features(self) -> int:
        if self.method == "eagle3":
            return len(self.aux_layer_ids) * self.target_hidden_size  # cat of the aux states
        return 2 * self.hidden_size  # cat(embedding, target hidden)

    @property
    def layer_names(self) -> list[str]:
        return [f"layers.{i}" for i in range(self.num_hidden_layers)]

    # The target loader's strict checker (compiled_spec.models.loader.check_checkpoint) reads these
    # two attributes from ``model.config``; providing them lets the draft reuse it unchanged.
    @property
    def architecture(self) -> str:
        return {"eagle": "EAGLE-1 draft", "eagle3": "EAGLE-3 draft"}[self.method]

    @property
    def tie_word_embeddings(self) -> bool:
        return False

    def layer_config(self) -> ModelConfig:
        """A Llama ``ModelConfig`` describing one draft layer, for our Attention/rope modules."""
        return ModelConfig(
            architecture="llama", vocab_size=self.target_vocab_size or self.draft_vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling, max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=False, attention_bias=self.attention_bias, qk_norm=False,
            o_proj_bias=self.attention_bias)

    # --- parsing -------------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, config_dict: dict[str, Any],
                        tensor_names: Iterable[str] | Mapping[str, tuple[int, ...]],
                        target_config: ModelConfig, method: str | None = None,
                        num_target_layers: int | None = None) -> "DraftConfig":
        """Build from a head's parsed ``config.json`` and its tensor names (a name -> shape mapping
        enables the width-based checks). ``method`` is detected from the tensors when None; an
        explicit one that contradicts them raises. ``num_target_layers`` overrides the target
        config's depth for the EAGLE-3 default aux ids and their range check."""
        shapes = ({rename_key(k): tuple(v) for k, v in tensor_names.items()}
                  if isinstance(tensor_names, Mapping) else None)
        names = {rename_key(n) for n in tensor_names}
        detected = detect_method(names, shapes, target_config.hidden_size)
        if method is not None and method not in METHODS:
            raise ValueError(f"unknown draft method {method!r}; expected one of {METHODS}")
        if method is not None and detected is not None and method != detected:
            raise ValueError(f"method={method!r} was requested but the checkpoint is an "
                             f"{detected!r} head (tensors: {sorted(names)[:6]}...)")
        method = method or detected
        if method is None:
            raise ValueError(f"cannot tell whether this is an EAGLE-1 or EAGLE-3 head from its "
                             f"tensors {sorted(names)[:8]}; pass method='eagle' or 'eagle3'")
        # Reuse the target parser for everything a Llama layer needs (rope variants, head_dim,
        # silu-only, no mlp bias); the EAGLE-3 architecture names are not target architectures.
        llama = ModelConfig.from_hf_dict(dict(config_dict, architectures=["LlamaForCausalLM"],
                                              model_type="llama"))
        num_layers = num_target_layers or target_config.num_hidden_layers
        eagle_cfg = config_dict.get("eagle_config") or {}
        if method == "eagle3":
            if eagle_cfg.get("use_aux_hidden_state", True) is False:
                raise ValueError("EAGLE-3 heads with use_aux_hidden_state=false are not supported")
            aux = eagle_cfg.get("eagle_aux_hidden_state_layer_ids")
            aux = tuple(aux) if aux else (2, num_layers // 2, num_layers - 3)
            target_h = int(config_dict.get("target_hidden_size") or target_config.hidden_size)
            draft_vocab = int(config_dict.get("draft_vocab_size") or llama.vocab_size)
        else:
            aux, target_h, draft_vocab = (), target_config.hidden_size, llama.vocab_size
        bias = config_dict.get("bias")
        if bias is None:  # EAGLE's own loader defaults to a biased fc when the key is absent
            bias = "fc.bias" in names
        cfg = cls(
            method=method, hidden_size=llama.hidden_size,
            intermediate_size=llama.intermediate_size, num_hidden_layers=llama.num_hidden_layers,
            num_attention_heads=llama.num_attention_heads,
            num_key_value_heads=llama.num_key_value_heads, head_dim=llama.head_dim,
            rms_norm_eps=llama.rms_norm_eps, rope_theta=llama.rope_theta,
            rope_scaling=llama.rope_scaling,
            max_position_embeddings=llama.max_position_embeddings, draft_vocab_size=draft_vocab,
            target_hidden_size=target_h, aux_layer_ids=aux,
            bias=bool(bias) and method == "eagle", target_vocab_size=target_config.vocab_size,
            attention_bias=llama.attention_bias,
            norm_before_residual=bool(config_dict.get("norm_before_residual", False)))
        cfg.check_fits(target_config, llama.vocab_size, num_layers, shapes)
        return cfg

    def check_fits(self, target: ModelConfig, config_vocab: int, num_target_layers: int,
                   shapes: Mapping[str, tuple[int, ...]] | None) -> None:
        """Reject a head built for another target, naming both values."""
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"draft target_hidden_size {self.target_hidden_size} != target "
                             f"hidden size {target.hidden_size}")
        if config_vocab != target.vocab_size:
            raise ValueError(f"draft config vocab_size {config_vocab} != target vocab size "
                             f"{target.vocab_size}")
        for i in self.aux_layer_ids:
            if not 0 <= i <= num_target_layers:
                raise ValueError(f"aux layer id {i} outside [0, {num_target_layers}] for a "
                                 f"{num_target_layers}-layer target")
        fc = (shapes or {}).get("fc.weight")
        if fc is not None and tuple(fc) != (self.hidden_size, self.fc_in_features):
            what = (f"{len(self.aux_layer_ids)} aux states of target hidden "
                    f"{self.target_hidden_size}" if self.method == "eagle3"
                    else f"cat(embedding, hidden) of width 2*{self.hidden_size}")
            raise ValueError(f"fc.weight has shape {tuple(fc)} but this target needs "
                             f"{(self.hidden_size, self.fc_in_features)} ({what}; target hidden "
                             f"size {target.hidden_size})")


def rename_key(name: str) -> str:
    """EAGLE-3 single-layer checkpoints call layer 0 ``midlayer``; we name it ``layers.0``."""
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def detect_method(names: set[str], shapes: Mapping[str, tuple[int, ...]] | None,
                  target_hidden: int) -> str | None:
    """'eagle3' if any EAGLE-3-only tensor (d2t/t2d, hidden_norm, final norm, lm_head, midlayer)
    is present or fc reads 3 target-hidden-wide states; 'eagle' if fc reads cat(embed, hidden) =
    [h, 2h] and none of those is present; None when undecidable (e.g. no fc)."""
    if any(n in _EAGLE3_ONLY or n.endswith(".hidden_norm.weight") for n in names):
        return "eagle3"
    fc = (shapes or {}).get("fc.weight")
    if fc is not None and len(fc) == 2:
        if fc[1] == 2 * fc[0]:
            return "eagle"
        if fc[1] == 3 * target_hidden:
            return "eagle3"
        return None
    return "eagle" if "fc.weight" in names else None
