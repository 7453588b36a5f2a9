"""What one propose call drafts for (its own module: the proposer and the first-pass split
both build it)."""
from __future__ import annotations

from dataclasses import dataclass

from compiled_spec.engine.batch import Span


@dataclass
class ProposeBatch:
    """One propose call. Row b of the result belongs to ``first_pass[b].req_id``."""

    first_pass: list[Span]  # accepted target positions per request
    token_ids: list[int]  # [sum of first-pass lengths]: the token after each position
    hidden_rows: list[int]  # rows of the target's hidden states, same order as token_ids
    step_limits: list[int]  # per request: positions >= this are inert in steps 2..k
    temperature: list[float]  # per request, 0 = greedy
    seeds: list[int]  # per request
