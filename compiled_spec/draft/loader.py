"""Load a public EAGLE-1 / EAGLE-3 draft head (``config.json`` + safetensors) for a loaded target.

As strict as the target loader (whose key/shape checker it reuses): every draft parameter must come
from the checkpoint with the exact shape and nothing else may be present, except ``t2d`` (accepted,
unused) and ``d2t`` (validated, loaded as an int64 buffer), and an EAGLE-3 ``lm_head`` left out by
a head whose config.json says ``lm_head_from_target`` (its rows are then the target's lm_head rows
at the draft vocabulary: heads trained with a frozen readout). Heads built for another target are
rejected with both values named. Only safetensors are read; pickle checkpoints never are.
"""
from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from compiled_spec.models.file_errors import reading

from compiled_spec.draft.config import LM_HEAD_FROM_TARGET, DraftConfig, rename_key
from compiled_spec.draft.model import EagleDraft
from compiled_spec.models.decoder import CausalLM
from compiled_spec.models.loader import (
    read_config_json,
    _safetensors_device,
    _safetensors_files,
    check_checkpoint,
    load_tensors,
)

_INDEX_KEYS = ("d2t", "t2d")  # integer / bool tensors, checked here rather than as parameters


def load_draft(path: str, target: CausalLM, dtype: torch.dtype,
               device: torch.device | str = "cpu", method: str | None = None,
               num_target_layers: int | None = None) -> EagleDraft:
    """Load the head at ``path`` as an eval-mode, grad-free ``EagleDraft`` sharing ``target``'s
    embedding (when the head has none) and, for EAGLE-1, its lm_head. ``method`` ('eagle' |
    'eagle3') is detected when None; ``num_target_layers`` overrides the target's depth for the
    EAGLE-3 default aux layer ids (2, L//2, L-3)."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"draft head directory does not exist: {path}")
    raw = _read_config(p)
    files = _safetensors_files(p)

    # Headers first: every naming/shape problem is reported before any data is read.
    shapes: dict[str, tuple[int, ...]] = {}
    source: dict[str, tuple[Path, str]] = {}  # our key -> (file, checkpoint key)
    duplicates: list[str] = []
    for f in files:
        with reading(f), safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                ours = rename_key(key)
                if ours in source:
                    duplicates.append(f"key {key!r} duplicates {source[ours][1]!r} "
                                      f"(both load as {ours!r})")
                source[ours] = (f, key)
                shapes[ours] = tuple(st.get_slice(key).get_shape())

    try:
        config = DraftConfig.from_checkpoint(raw, shapes, target.config, method=method,
                                             num_target_layers=num_target_layers)
    except ValueError as e:  # name the head: config-level errors would not say which file
        raise ValueError(f"draft head {p / 'config.json'}: {e}") from None
    with torch.device("meta"):  # no memory, no random init; tensors are swapped in below
        draft = EagleDraft(config, target, own_embedding="embed_tokens.weight" in shapes)
    index_shapes = {k: shapes.pop(k) for k in _INDEX_KEYS if k in shapes}
    extra = list(duplicates) + _index_problems(config, index_shapes)
    # A head trained with a frozen readout stores no lm_head: its rows are the target's at the
    # draft vocabulary (``LM_HEAD_FROM_TARGET`` in config.json), rebuilt here from d2t.
    tied = (config.method == "eagle3" and bool(raw.get(LM_HEAD_FROM_TARGET))
            and "lm_head.weight" not in shapes)
    if tied:
        shapes["lm_head.weight"] = (config.draft_vocab_size, config.hidden_size)
        if config.hidden_size != target.config.hidden_size:
            extra.append(f"{LM_HEAD_FROM_TARGET} needs the target's hidden size "
                         f"{target.config.hidden_size}, the head has {config.hidden_size}")
    to_load = check_checkpoint(draft, shapes, str(p), extra_problems=extra)

    with ExitStack() as stack:
        with reading(p, "draft head"):
            opened = {f: stack.enter_context(safe_open(str(f), framework="pt",
                                                       device=_safetensors_device(device)))
                      for f in files}

        def get(key: str) -> torch.Tensor:
            if tied and key == "lm_head.weight":
                return readout[(torch.arange(d2t.numel(), device=d2t.device) + d2t).to(
                    readout.device)]
            f, checkpoint_key = source[key]
            with reading(f):
                return opened[f].get_tensor(checkpoint_key)

        if config.method == "eagle3":  # checked first: a tied lm_head is gathered through it
            d2t = (get("d2t").to(device=device, dtype=torch.int64) if "d2t" in index_shapes
                   else torch.zeros(config.draft_vocab_size, dtype=torch.int64, device=device))
            _check_d2t(d2t.cpu(), config.target_vocab_size or 0, str(p))
        if tied:  # [V, h]: a vocabulary-parallel target holds V/tp rows per rank, so gather
            full = getattr(target.lm_head, "full_weight", None)
            readout = full() if full is not None else target.lm_head.weight.detach()
        load_tensors(draft, to_load, get, dtype, device)
        if config.method == "eagle3":
            draft.d2t = d2t
    return _finalize(draft, device)


def _read_config(model_dir: Path) -> dict[str, Any]:
    return read_config_json(model_dir, "an EAGLE head directory (config.json + model.safetensors)")


def _index_problems(config: DraftConfig, shapes: dict[str, tuple[int, ...]]) -> list[str]:
    problems = []
    if config.method == "eagle":
        problems += [f"unexpected key {k!r} (shape {s}) in an EAGLE-1 head"
                     for k, s in shapes.items()]
        return problems
    want = {"d2t": (config.draft_vocab_size,), "t2d": (config.target_vocab_size,)}
    for key, shape in shapes.items():
        if shape != want[key]:
            problems.append(f"shape mismatch for {key!r}: checkpoint {shape} vs model {want[key]}")
    if "d2t" not in shapes and config.draft_vocab_size != config.target_vocab_size:
        problems.append(f"missing key 'd2t' (model expects shape {want['d2t']}): a draft vocab "
                        f"of {config.draft_vocab_size} != target vocab "
                        f"{config.target_vocab_size} needs the draft->target id map")
    return problems


def _check_d2t(d2t: torch.Tensor, target_vocab: int, source: str) -> None:
    target_ids = torch.arange(d2t.shape[0]) + d2t  # [draft_vocab]
    bad = (target_ids < 0) | (target_ids >= target_vocab)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"{source}: d2t maps draft id {i} to target id {int(target_ids[i])}, "
                         f"outside the target vocab [0, {target_vocab})")
    if target_ids.unique().numel() != target_ids.numel():
        raise ValueError(f"{source}: d2t maps several draft ids to the same target id")


def _finalize(draft: EagleDraft, device: torch.device | str) -> EagleDraft:
    draft.rotary_emb.build_cache(device)  # rope tables are derived, never in the checkpoint
    leftover = [n for n, t in [*draft.named_parameters(), *draft.named_buffers()] if t.is_meta]
    if leftover:  # unreachable after check_checkpoint; guards against future loader bugs
        raise RuntimeError(f"draft tensors left uninitialised after loading: {leftover[:5]}")
    draft.eval()
    draft.requires_grad_(False)
    return draft
