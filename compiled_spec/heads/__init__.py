"""Draft heads shipped with the package, addressable by name wherever a head path is taken.

``smollm2-eagle3``: EAGLE-3 head for SmolLM2-135M-Instruct (the default target), trained by
``compiled-spec train`` (packed TTT, 5 steps) on the target's own multi-turn answers to ShareGPT,
Alpaca and CodeAlpaca prompts; bf16, one layer, 32768-token draft vocabulary whose readout is
the target's own lm_head rows (``lm_head_from_target``: rebuilt at load from ``d2t``, not stored).
How it was trained and what it accepts: profiles/results/2026-12-01_h200_packed-ttt/ (first
training), profiles/results/2026-12-01_h200_continued-head/ and
profiles/results/2026-12-01_h200_session4/ (continued on fresh data),
profiles/results/2026-12-01_h200_session5/ (the current weights) and
profiles/results/HISTORY.md.
"""
from __future__ import annotations

from pathlib import Path

SHIPPED: dict[str, str] = {"smollm2-eagle3": "smollm2-135m-instruct-eagle3"}


def resolve_draft(draft: str | None) -> str | None:
    """A shipped head's name -> its directory; anything else is returned unchanged."""
    if draft in SHIPPED:
        return str(Path(__file__).parent / SHIPPED[draft])
    return draft
