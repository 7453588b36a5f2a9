"""Load a checkpoint into our ``CausalLM``: a Hugging Face directory of safetensors, or a GGUF file.

Loading is strict: every model parameter must come from the checkpoint with the exact shape and the
checkpoint may hold nothing we would ignore, because a silently skipped tensor (say a bias our
config forgot) gives a model that runs and is quietly wrong. Only safetensors are read: pickle
checkpoints (``.bin``, ``torch.load``) can execute code, and remote code is never trusted.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from compiled_spec.models.config import ModelConfig
from compiled_spec.models.decoder import CausalLM

MAX_REPORTED_PROBLEMS = 5
# Checkpoints written by older transformers carry rope buffers; we derive rope from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(path: str, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> tuple[CausalLM, ModelConfig]:
    """Load ``path`` (HF directory or ``.gguf`` file) as an eval-mode, grad-free model with
    parameters in ``dtype`` on ``device``."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a Hugging Face model "
                             "directory (config.json + *.safetensors) or a .gguf file")
        from compiled_spec.models.gguf_loader import load_gguf  # lazy: gguf is only needed here

        return load_gguf(str(p), dtype, device)
    config = read_hf_config(p)
    files = _safetensors_files(p)

    # Read only the headers first, so every key/shape problem is reported before any data moves.
    shapes: dict[str, tuple[int, ...]] = {}
    owner: dict[str, Path] = {}
    duplicates: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in owner:
                    duplicates.append(f"key {key!r} appears in both {owner[key].name} and {f.name}")
                owner[key] = f
                shapes[key] = tuple(st.get_slice(key).get_shape())
    model = build_empty_model(config, dtype, device)
    to_load = check_checkpoint(model, shapes, str(p), extra_problems=duplicates)

    params = dict(model.named_parameters())
    with torch.no_grad():
        for f in files:
            keys = [k for k in to_load if owner[k] == f]
            if not keys:
                continue
            # safe_open with a device maps the tensor straight there; the cast then happens on
            # the target device, one tensor at a time, so peak memory stays ~ one model copy.
            with safe_open(str(f), framework="pt", device=str(torch.device(device))) as st:
                for key in keys:
                    params[key].copy_(st.get_tensor(key).to(dtype))
    return finalize_model(model), config


def read_hf_config(model_dir: Path) -> ModelConfig:
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(
            f"{model_dir} has no config.json; expected a Hugging Face model directory "
            "(config.json + *.safetensors) or a .gguf file")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed JSON in {cfg_file}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"malformed {cfg_file}: expected a JSON object, got {type(raw).__name__}")
    return ModelConfig.from_hf_dict(raw)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"malformed {index}: {e!r}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard(s) that do not exist: {missing}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors weights in {model_dir} (pickle .bin checkpoints are not loaded)")
    return files


def build_empty_model(config: ModelConfig, dtype: torch.dtype,
                      device: torch.device | str) -> CausalLM:
    """Allocate the model on ``device`` without running random init (its values would be
    overwritten anyway, and init of a multi-billion-parameter model takes minutes)."""
    with torch.device("meta"):
        model = CausalLM(config)
    model.to(dtype=dtype)  # free on meta: only records the dtype
    model.to_empty(device=device)
    # to_empty swaps in new Parameter objects, which breaks lm_head/embedding sharing, and leaves
    # the non-persistent rope tables uninitialised.
    model.tie_weights()
    model.model.rotary_emb.build_cache(device)
    return model


def expected_shapes(model: CausalLM) -> dict[str, tuple[int, ...]]:
    # named_parameters de-duplicates shared tensors: with tied embeddings lm_head.weight is absent.
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def check_checkpoint(model: CausalLM, shapes: dict[str, tuple[int, ...]], source: str,
                     extra_problems: Iterable[str] = ()) -> list[str]:
    """Compare checkpoint keys/shapes with the model's parameters; raise ValueError listing the
    first few problems, else return the checkpoint keys to load."""
    expected = expected_shapes(model)
    tied = model.config.tie_word_embeddings
    problems = list(extra_problems)
    to_load: list[str] = []
    for key, shape in shapes.items():
        if key.endswith(_IGNORED_SUFFIXES):
            continue
        if tied and key == "lm_head.weight":
            # Some tied checkpoints also store the (identical) head; it must still fit.
            want = expected["model.embed_tokens.weight"]
            if shape != want:
                problems.append(f"shape mismatch for 'lm_head.weight': checkpoint {shape} vs "
                                 f"model {want}")
            continue
        if key not in expected:
            problems.append(f"unexpected key {key!r} (shape {shape})")
        elif shape != expected[key]:
            problems.append(f"shape mismatch for {key!r}: checkpoint {shape} vs model "
                            f"{expected[key]}")
        else:
            to_load.append(key)
    for key, want in expected.items():
        if key not in shapes:
            problems.append(f"missing key {key!r} (model expects shape {want})")
    if problems:
        shown = "; ".join(problems[:MAX_REPORTED_PROBLEMS])
        more = len(problems) - MAX_REPORTED_PROBLEMS
        raise ValueError(
            f"checkpoint {source} does not match the {model.config.architecture} model: "
            f"{len(problems)} problem(s): {shown}" + (f"; ... and {more} more" if more > 0 else ""))
    return to_load


def load_tensors(model: CausalLM, keys: Iterable[str],
                 get: Callable[[str], torch.Tensor]) -> None:
    """Copy ``get(key)`` into each named (already shape-checked) parameter."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for key in keys:
            p = params[key]
            p.copy_(get(key).to(device=p.device, dtype=p.dtype))


def finalize_model(model: CausalLM) -> CausalLM:
    model.eval()
    model.requires_grad_(False)  # inference only: no autograd bookkeeping in the hot path
    return model
