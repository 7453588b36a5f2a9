"""Draft heads shipped with the package, addressable by name wherever a head path is taken.

``smollm2-eagle3``: EAGLE-3 head for SmolLM2-135M-Instruct (the default target), trained by
``compiled-spec train`` on the project's self-distilled prompts; bf16, 8192-token draft
vocabulary, two safetensors shards. How it was trained and what it accepts:
profiles/results/2026-11-30_h200_train-smollm2-run2/ and profiles/results/HISTORY.md.
"""
from __future__ import annotations

from pathlib import Path

SHIPPED: dict[str, str] = {"smollm2-eagle3": "smollm2-135m-instruct-eagle3"}


def resolve_draft(draft: str | None) -> str | None:
    """A shipped head's name -> its directory; anything else is returned unchanged."""
    if draft in SHIPPED:
        return str(Path(__file__).parent / SHIPPED[draft])
    return draft
