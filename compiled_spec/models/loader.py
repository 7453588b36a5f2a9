"""Load a checkpoint into our ``CausalLM``: a Hugging Face directory of safetensors, or a GGUF file.

Loading is strict: every model parameter must come from the checkpoint with the exact shape and the
checkpoint may hold nothing we would ignore, because a silently skipped tensor (say a bias our
config forgot) gives a model that runs and is quietly wrong. Only safetensors are read: pickle
checkpoints (``.bin``, ``torch.load``) can execute code, and remote code is never trusted.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from compiled_spec.models.file_errors import reading

from compiled_spec.models.config import ModelConfig
from compiled_spec.models.decoder import CausalLM
# Re-exported: the strict build-check-install steps every checkpoint format shares.
from compiled_spec.models.materialize import (MAX_REPORTED_PROBLEMS, build_meta_model,  # noqa: F401
                                              check_checkpoint, expected_shapes, finalize_model,
                                              load_tensors)

RANDOM_PREFIX = "random:"  # "random:DIR": DIR's config.json with random weights (benchmarks)


def load_model(path: str, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> tuple[CausalLM, ModelConfig]:
    """Load ``path`` (HF directory or ``.gguf`` file) as an eval-mode, grad-free model with
    parameters in ``dtype`` on ``device``. ``random:DIR`` builds DIR's architecture with random
    weights instead (latency benchmarks of shapes whose weights are not at hand, e.g. 8B)."""
    if str(path).startswith(RANDOM_PREFIX):
        return random_model(Path(str(path)[len(RANDOM_PREFIX):]), dtype, device)
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
        with reading(f), safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in owner:
                    duplicates.append(f"key {key!r} appears in both {owner[key].name} and {f.name}")
                owner[key] = f
                shapes[key] = tuple(st.get_slice(key).get_shape())
    model = build_meta_model(config)
    to_load = check_checkpoint(model, shapes, str(p), extra_problems=duplicates)

    for f in files:
        keys = [k for k in to_load if owner[k] == f]
        if keys:
            # With a device, safe_open maps each tensor straight there; the cast then runs on
            # the target device one tensor at a time.
            with reading(f), safe_open(str(f), framework="pt",
                                       device=_safetensors_device(device)) as st:
                load_tensors(model, keys, st.get_tensor, dtype, device)
    return finalize_model(model, device), config


def _safetensors_device(device: torch.device | str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # safetensors wants an explicit ordinal
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


def read_model_config(path: str) -> ModelConfig:
    """The ``ModelConfig`` of an HF directory, a ``.gguf`` (metadata only) or ``random:DIR``,
    without loading any weights."""
    p = Path(str(path)[len(RANDOM_PREFIX):] if str(path).startswith(RANDOM_PREFIX) else path)
    if p.is_file() and p.suffix.lower() == ".gguf":
        import gguf

        from compiled_spec.models.gguf_loader import config_from_gguf

        with reading(p, "GGUF file"):
            return config_from_gguf(gguf.GGUFReader(str(p)), str(p))
    return read_hf_config(p)


def random_model(model_dir: Path, dtype: torch.dtype, device: torch.device | str,
                 seed: int = 0) -> tuple[CausalLM, ModelConfig]:
    """``model_dir/config.json``'s model with N(0, 0.02) weights (norms 1), made on ``device``
    directly: no checkpoint, no host copy. Same seed, same weights."""
    config = read_hf_config(model_dir)
    model = build_meta_model(config)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(model.named_parameters()):
        module_name, _, attr = name.rpartition(".")
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if "norm" in name:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        model.get_submodule(module_name)._parameters[attr] = torch.nn.Parameter(
            t, requires_grad=False)
    return finalize_model(model, device), config


def read_hf_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf_dict(read_config_json(
        model_dir, "a Hugging Face model directory (config.json + *.safetensors) or a .gguf file"))


def read_config_json(model_dir: Path, expected: str) -> dict[str, Any]:
    """``model_dir/config.json`` as a dict; errors name the file and say what was ``expected``."""
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; expected {expected}")
    try:
        raw = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed JSON in {cfg_file}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"malformed {cfg_file}: expected a JSON object, got {type(raw).__name__}")
    return raw


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
