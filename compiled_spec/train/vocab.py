"""Draft vocabulary selection for EAGLE-3 heads.

The draft predicts over a reduced vocabulary: the ``draft_vocab_size`` target tokens that occur most
often in the training responses (what the draft must actually predict), sorted by token id as the
published heads are. The mapping is stored the EAGLE-3 way: ``d2t[draft_id] = target_id -
draft_id`` (int64 offsets) and ``t2d[target_id]`` (bool membership).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch


def count_tokens(sequences: Iterable[Iterable[int]]) -> Counter[int]:
    """Occurrences of each token id over all ``sequences``."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(int(t) for t in seq)
    return counts


def _ranked(counts: Counter[int] | dict[int, int], target_vocab: int) -> list[int]:
    """Ids with a positive count, most frequent first; ties broken by the lower id so the choice
    is deterministic (a Counter's own order depends on insertion order)."""
    items = [(c, t) for t, c in counts.items() if c > 0]
    for _, t in items:
        if not 0 <= t < target_vocab:
            raise ValueError(f"token id {t} outside the target vocab [0, {target_vocab})")
    return [t for _, t in sorted(items, key=lambda ct: (-ct[0], ct[1]))]


def select_draft_vocab(response_counts: Counter[int] | dict[int, int], draft_vocab_size: int,
                       target_vocab: int,
                       prompt_counts: Counter[int] | dict[int, int] | None = None
                       ) -> torch.Tensor:  # [draft_vocab_size] int64, ascending target ids
    """The ``draft_vocab_size`` most frequent response tokens. When the responses hold fewer
    distinct tokens, the rest is filled with the most frequent prompt tokens not yet chosen, then
    with the lowest unused ids, so the size is always exactly ``draft_vocab_size``."""
    if isinstance(draft_vocab_size, bool) or not isinstance(draft_vocab_size, int) \
            or not 0 < draft_vocab_size <= target_vocab:
        raise ValueError(f"draft_vocab_size={draft_vocab_size!r} must be an int in "
                         f"[1, target vocab {target_vocab}]")
    chosen: list[int] = []
    seen: set[int] = set()
    fallback = range(target_vocab)  # lowest ids last: no data says anything about them
    for source in (_ranked(response_counts, target_vocab),
                   _ranked(prompt_counts or {}, target_vocab), fallback):
        for t in source:
            if len(chosen) == draft_vocab_size:
                break
            if t not in seen:
                seen.add(t)
                chosen.append(t)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def vocab_maps(draft_ids: torch.Tensor,  # [draft_vocab] ascending target ids
               target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:  # (d2t, t2d)
    """``d2t`` [draft_vocab] int64 with target_id = draft_id + d2t[draft_id]; ``t2d`` [V] bool."""
    ids = draft_ids.to(torch.int64).cpu()
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"draft ids must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
    if bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError("draft ids must be strictly ascending (sorted, no duplicates)")
    if int(ids[0]) < 0 or int(ids[-1]) >= target_vocab:
        raise ValueError(f"draft ids span [{int(ids[0])}, {int(ids[-1])}], outside the target "
                         f"vocab [0, {target_vocab})")
    d2t = ids - torch.arange(ids.numel(), dtype=torch.int64)
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def draft_ids_from_d2t(d2t: torch.Tensor) -> torch.Tensor:  # [draft_vocab] -> [draft_vocab]
    """Inverse of ``vocab_maps``: the target id of every draft id."""
    return torch.arange(d2t.shape[0], dtype=torch.int64, device=d2t.device) + d2t.to(torch.int64)
