"""Draft heads shipped with the package, addressable by name wherever a head path is taken.

``smollm2-eagle3``: EAGLE-3 head for SmolLM2-135M-Instruct (the default target), trained by
``compiled-spec train`` (packed TTT, 5 steps) on the target's own multi-turn answers to ShareGPT,
Alpaca and CodeAlpaca prompts; bf16, one layer, 32768-token draft vocabulary whose readout is
the target's own lm_head rows (``lm_head_from_target``: rebuilt at load from ``d2t``, not stored).
How it was trained and what it accepts: profiles/results/2026-12-01_h200_packed-ttt/ (first
training), then continued on fresh data in the third to sixth and the ninth to sixteenth sessions
(``SHIPPED_WEIGHTS`` names the result folder of the current weights; profiles/results/HISTORY.md
has the rest).
"""
from __future__ import annotations

from pathlib import Path

SHIPPED: dict[str, str] = {"smollm2-eagle3": "smollm2-135m-instruct-eagle3"}

# Each shipped head's weights file: its sha256 and the result folder that measured exactly those
# weights. Shipping new weights means changing both here (a test checks the hash), so the
# figures the docs quote cannot silently belong to weights that were never committed (the
# seventh session's head was reported shipped but not committed; eighth session's correction).
SHIPPED_WEIGHTS: dict[str, tuple[str, str]] = {
    "smollm2-eagle3": ("424ef5cc0e239e4df17b3d030b09da0b63a5fb220ca720c94102e2fda476dbe9",
                       "profiles/results/2026-12-02_h200_session16/"),
}


def resolve_draft(draft: str | None) -> str | None:
    """A shipped head's name -> its directory; anything else is returned unchanged."""
    if draft in SHIPPED:
        return str(Path(__file__).parent / SHIPPED[draft])
    return draft
