"""Build a model on the meta device, check a checkpoint's keys and shapes against it, install
its tensors and finish it: the strict steps shared by every checkpoint format (safetensors in
``loader.py``, GGUF in ``gguf_loader.py``, EAGLE heads in ``draft/loader.py``).

Kept below both loaders so that ``gguf_loader`` does not import ``loader``, which dispatches to it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from compiled_spec.models.config import ModelConfig
from compiled_spec.models.decoder import CausalLM

MAX_REPORTED_PROBLEMS = 5
# Checkpoints written by older transformers carry rope buffers; we derive rope from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
