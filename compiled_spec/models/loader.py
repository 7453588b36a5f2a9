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
from typing import Any

import torch
from safetensors import safe_open

from compiled_spec.models.file_errors import reading

from compiled_spec.models.config import ModelConfig
from compiled_spec.models.decoder import CausalLM

MAX_REPORTED_PROBLEMS = 5
RANDOM_PREFIX = "random:"  # "random:DIR": DIR's config.json with random weights (benchmarks)
# Checkpoints written by older transformers carry rope buffers; we derive rope from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def build_meta_model(config: ModelConfig) -> CausalLM:
    """Build the module tree on the meta device: no memory, no random init (which would be
    overwritten anyway and takes minutes for multi-billion-parameter models). Parameters are then
    swapped in one by one from the checkpoint, so peak memory is ~one model copy."""
    with torch.device("meta"):
        return CausalLM(config)


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


def load_tensors(model: CausalLM, keys: Iterable[str], get: Callable[[str], torch.Tensor],
                 dtype: torch.dtype, device: torch.device | str) -> None:
    """Install ``get(key)`` (cast to dtype/device) as each named, already shape-checked
    parameter of a meta-built model."""
    for key in keys:
        module_name, _, attr = key.rpartition(".")
        module = model.get_submodule(module_name)
        tensor = get(key).to(device=device, dtype=dtype)
        module._parameters[attr] = torch.nn.Parameter(tensor, requires_grad=False)


def finalize_model(model: CausalLM, device: torch.device | str) -> CausalLM:
    # Re-share the head with the (newly installed) embedding, and fill the non-persistent rope
    # tables, which the checkpoint does not carry, on the real device.
    model.tie_weights()
    model.model.rotary_emb.build_cache(device)
    leftover = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if leftover:  # unreachable after check_checkpoint; guards against future loader bugs
        raise RuntimeError(f"parameters left uninitialised after loading: {leftover[:5]}")
    model.eval()
    model.requires_grad_(False)  # inference only: no autograd bookkeeping in the hot path
    return model
