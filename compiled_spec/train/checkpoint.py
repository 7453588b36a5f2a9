"""Saving trained heads in the published EAGLE-3 layout, and the trainer's resume state.

The head is ``config.json`` + ``model.safetensors`` with the keys public EAGLE-3 loaders read:
``fc.weight``, ``midlayer.*`` (one layer; ``layers.N.*`` for deeper drafts), ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d``. The embedding is the target's and is not saved; so is the
lm_head of a head trained with it frozen at the target's rows (config ``lm_head_from_target``). Optimizer state
is a plain ``torch.save`` dict of tensors and numbers, only ever read with ``weights_only=True``.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from compiled_spec.draft.config import LM_HEAD_FROM_TARGET, DraftConfig, rename_key
from compiled_spec.draft.model import EagleDraft
from compiled_spec.models.config import ModelConfig

HEAD_FILES = ("config.json", "model.safetensors")
STATE_FILE = "trainer_state.pt"


def eagle3_config_dict(cfg: DraftConfig, target: ModelConfig) -> dict[str, Any]:
    """A Llama ``config.json`` plus the EAGLE-3 fields (SpecForge / vLLM / SGLang spelling)."""
    scaling = cfg.rope_scaling
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": None if scaling is None else {
            "rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings},
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": cfg.attention_bias, "mlp_bias": False, "pretraining_tp": 1,
        "initializer_range": 0.02, "tie_word_embeddings": False, "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": target.bos_token_id,
        "eos_token_id": target.eos_token_ids[0] if target.eos_token_ids else None,
        "vocab_size": target.vocab_size, "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
                         "use_aux_hidden_state": True},
    }


def _checkpoint_key(name: str, num_layers: int) -> str:
    # Single-layer heads are published with ``midlayer.``; deeper ones keep ``layers.N.``.
    if num_layers == 1 and name.startswith("layers.0."):
        return "midlayer." + name[len("layers.0."):]
    return name


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)  # a crash mid-save never leaves a half-written checkpoint


def lm_head_frozen(draft: EagleDraft) -> bool:
    """An EAGLE-3 head trained with the target's own readout rows: its lm_head is not saved."""
    return draft.config.method == "eagle3" and not draft.lm_head.weight.requires_grad


def save_head(draft: EagleDraft, t2d: torch.Tensor, out_dir: Path) -> None:
    cfg = draft.config
    skip = {"d2t"} | ({"lm_head.weight"} if lm_head_frozen(draft) else set())
    sd = {_checkpoint_key(k, cfg.num_hidden_layers): v.detach().float().cpu().contiguous()
          for k, v in draft.state_dict().items() if k not in skip}
    sd["d2t"] = draft.d2t.detach().to(torch.int64).cpu().contiguous()
    sd["t2d"] = t2d.to(torch.bool).cpu().contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    _atomic(out_dir / "model.safetensors",
            lambda p: save_file(sd, str(p), metadata={"format": "pt"}))
    config = eagle3_config_dict(cfg, draft.target.config)
    if lm_head_frozen(draft):
        config[LM_HEAD_FROM_TARGET] = True
    text = json.dumps(config, indent=2)
    _atomic(out_dir / "config.json", lambda p: p.write_text(text))


def head_files(head_dir: Path) -> list[Path]:
    """The head's safetensors files: one file or the shards an index lists."""
    from compiled_spec.models.loader import _safetensors_files

    return _safetensors_files(Path(head_dir))


def load_head_into(draft: EagleDraft, out_dir: Path, grow: bool = False) -> torch.Tensor:
    """Copy a saved head's weights (one file or shards, any float dtype) into the trainable
    ``draft`` (resume, or a warm start); returns its t2d.

    ``grow``: ``draft`` may have more layers than the saved head (a deeper head warm-started
    from a shallower one). The extra layers start as identity blocks: their attention output
    and MLP down projections are zero, so each adds nothing to the residual stream and the
    grown head drafts exactly as the saved one until training moves them."""
    own = draft.state_dict()
    seen: set[str] = set()
    t2d = None
    for path in head_files(out_dir):
        _load_file_into(own, seen, path, out_dir)
        if t2d is None:
            with safe_open(str(path), framework="pt") as f:
                t2d = f.get_tensor("t2d") if "t2d" in f.keys() else None
    missing = set(own) - seen
    saved_cfg = json.loads((Path(out_dir) / "config.json").read_text())
    if saved_cfg.get(LM_HEAD_FROM_TARGET):
        missing.discard("lm_head.weight")  # the target's rows, already in place (build_head)
    if grow:
        n_saved = int(saved_cfg.get("num_hidden_layers", 1))
        new = {k for k in missing if k.startswith("layers.") and int(k.split(".")[1]) >= n_saved}
        with torch.no_grad():
            for k in new:
                if k.endswith(("self_attn.o_proj.weight", "self_attn.o_proj.bias",
                               "mlp.down_proj.weight")):
                    own[k].zero_()
        missing -= new
    if missing or t2d is None:
        raise ValueError(f"{out_dir}: saved head lacks {sorted(missing) or ['t2d']}")
    return t2d


def _load_file_into(own: dict[str, torch.Tensor], seen: set[str], path: Path,
                    out_dir: Path) -> None:
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            name = rename_key(key)
            if name == "t2d":
                continue
            if name not in own or tuple(own[name].shape) != tuple(f.get_slice(key).get_shape()):
                raise ValueError(f"{out_dir}: tensor {key!r} does not fit the head being "
                                 f"trained (different target or config?)")
            with torch.no_grad():
                own[name].copy_(f.get_tensor(key))
            seen.add(name)


def save_state(out_dir: Path, step: int, optimizer: torch.optim.Optimizer) -> None:
    state = {"step": step, "optimizer": optimizer.state_dict()}
    _atomic(out_dir / STATE_FILE, lambda p: torch.save(state, str(p)))


def load_state(out_dir: Path, device: torch.device) -> dict[str, Any]:
    # weights_only: tensors, numbers, lists and dicts only; never unpickles arbitrary objects.
    return torch.load(str(out_dir / STATE_FILE), map_location=device, weights_only=True)


_EXPORT_NAME = re.compile(r"^(config\.json|model\.safetensors|model\.safetensors\.index\.json|"
                          r"model-\d{5}-of-\d{5}\.safetensors)$")


def _clear_previous_export(dst: Path) -> None:
    """Remove what an earlier export left in ``dst`` (its shards and index would otherwise be
    what the loader reads: an index wins over model.safetensors). A folder holding anything
    else is refused: those files are not ours to delete."""
    if not dst.exists():
        return
    if not dst.is_dir():
        raise ValueError(f"export-head destination {dst} exists and is not a directory")
    entries = list(dst.iterdir())
    foreign = sorted(e.name for e in entries if not (e.is_file() and _EXPORT_NAME.match(e.name)))
    if foreign:
        raise ValueError(f"export-head destination {dst} holds files that are not a head "
                         f"export: {foreign[:5]}; give an empty or new directory")
    for e in entries:
        e.unlink()


def export_head(src: str | Path, dst: str | Path, dtype: str = "bfloat16",
                max_shard_mb: float | None = None) -> list[Path]:
    """Copy the head in ``src`` (one file or shards + index) to ``dst`` with its float tensors
    cast to ``dtype`` (``d2t`` / ``t2d`` keep theirs), split into shards of at most
    ``max_shard_mb`` MiB plus a ``model.safetensors.index.json`` when more than one file is
    needed (the HF sharded layout). A previous export in ``dst`` is replaced whole."""
    from compiled_spec.models.file_errors import reading

    src, dst = Path(src), Path(dst)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: not a head directory (config.json + model.safetensors "
                                "or shards with model.safetensors.index.json)")
    to = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(dtype)
    if to is None:
        raise ValueError(f"dtype={dtype!r}: expected bfloat16, float16 or float32")
    if max_shard_mb is not None and not max_shard_mb > 0:
        raise ValueError(f"max_shard_mb={max_shard_mb!r}: must be > 0")
    sd: dict[str, torch.Tensor] = {}
    for f in head_files(src):  # read everything before dst is touched (dst may be src)
        with reading(f):
            part = load_file(str(f))
        dup = sorted(set(part) & set(sd))
        if dup:
            raise ValueError(f"{src}: tensor {dup[0]!r} appears in more than one shard")
        sd.update({k: (v.to(to) if v.is_floating_point() else v).contiguous()
                   for k, v in part.items()})
    config = json.loads((src / "config.json").read_text())
    limit = float("inf") if max_shard_mb is None else max_shard_mb * 2**20
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    for k in sorted(sd):  # first fit, in key order: deterministic file contents
        nbytes = sd[k].numel() * sd[k].element_size()
        if nbytes > limit:
            raise ValueError(f"tensor {k!r} alone is {nbytes} bytes, over "
                             f"max_shard_mb={max_shard_mb}")
        i = next((i for i, n in enumerate(sizes) if n + nbytes <= limit), None)
        if i is None:
            shards.append({})
            sizes.append(0)
            i = len(shards) - 1
        shards[i][k] = sd[k]
        sizes[i] += nbytes
    _clear_previous_export(dst)
    dst.mkdir(parents=True, exist_ok=True)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        save_file(shard, str(dst / name), metadata={"format": "pt"})
    files = [dst / n for n in names]
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)},
                 "weight_map": {k: n for n, sh in zip(names, shards) for k in sh}}
        (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        files.append(dst / "model.safetensors.index.json")
    config["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return files + [dst / "config.json"]
