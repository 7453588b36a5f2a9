"""Speculative-decoding acceptance metrics, defined as vLLM / SGLang report them.

A drafting step is one verification of one request that had at least one draft token (vLLM's
`SpecDecodingStats.observe_draft` is only called for requests with drafts scheduled; a row with
k_i = 0 is plain decoding and would drag tau towards 1 without telling anything about the drafter).

  tau (mean acceptance length) = 1 + accepted / steps  (the +1 is the recovered or bonus token)
  a_j (per-position rate)      = steps where draft j was accepted / steps
  draft acceptance rate        = accepted / drafted

a_j divides by all steps, not only those that proposed a j-th draft, as vLLM does; with a fixed k
the two agree, and sum_j a_j = tau - 1 always holds.

Keep one SpecStats per request and `merge` them for the run, or feed one instance every row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecStats:
    num_spec_tokens: int = 0  # K, the length of accepted_per_position (grows if a step drafts more)
    num_drafting_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [K] steps accepting draft j

    def __post_init__(self) -> None:
        self._grow(max(self.num_spec_tokens, len(self.accepted_per_position)))

    def _grow(self, k: int) -> None:
        if k > len(self.accepted_per_position):
            self.accepted_per_position.extend([0] * (k - len(self.accepted_per_position)))
        self.num_spec_tokens = max(self.num_spec_tokens, k)

    def update(self, num_draft: list[int], num_accepted: list[int]) -> None:
        """Record one engine step: per row, drafts proposed (k_i) and drafts accepted (0..k_i)."""
        if len(num_draft) != len(num_accepted):
            raise ValueError(f"num_draft has {len(num_draft)} rows, num_accepted {len(num_accepted)}")
        for k, a in zip(num_draft, num_accepted):
            self.add(k, a)

    def add(self, k: int, a: int) -> None:
        """One row of ``update``: ``k`` drafts proposed, ``a`` accepted. (The engine records
        each request's own row every step: two one-element lists per request were a visible
        share of a batch-64 step's bookkeeping.)"""
        if not 0 <= a <= k:
            raise ValueError(f"need 0 <= num_accepted <= num_draft, got {a} of {k}")
        if k == 0:
            return  # no drafts: not a drafting step (see module docstring)
        if k > self.num_spec_tokens:
            self._grow(k)
        self.num_drafting_steps += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += a
        app = self.accepted_per_position
        for j in range(a):  # accepted drafts form a prefix: positions 0..a-1
            app[j] += 1

    def merge(self, other: SpecStats) -> SpecStats:
        """Add other's counts into self (e.g. per-request stats into the run's); returns self."""
        self._grow(other.num_spec_tokens)
        self.num_drafting_steps += other.num_drafting_steps
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for j, c in enumerate(other.accepted_per_position):
            self.accepted_per_position[j] += c
        return self

    @property
    def mean_acceptance_length(self) -> float | None:
        """tau = 1 + accepted / steps; None before any drafting step (no meaningful value)."""
        if self.num_drafting_steps == 0:
            return None
        return 1.0 + self.num_accepted_tokens / self.num_drafting_steps

    @property
    def acceptance_rate_per_position(self) -> list[float] | None:
        """a_j = steps where draft j was accepted / steps, j = 0..K-1; None before any step."""
        if self.num_drafting_steps == 0:
            return None
        return [c / self.num_drafting_steps for c in self.accepted_per_position]

    @property
    def draft_acceptance_rate(self) -> float | None:
        """accepted / drafted; None before any draft token."""
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "num_spec_tokens": self.num_spec_tokens,
            "num_drafting_steps": self.num_drafting_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "draft_acceptance_rate": self.draft_acceptance_rate,
        }
