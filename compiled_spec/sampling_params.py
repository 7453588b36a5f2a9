"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """What a user asks of one request. ``temperature == 0`` means greedy decoding.

    ``seed`` makes a request reproducible on its own: its random draws depend only on the seed and
    the position of the token being sampled, never on the other requests in the batch.
    """

    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    speculate: bool = True  # False: this request decodes plainly even in a speculative engine

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens", "must be an integer")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature != self.temperature:
            raise bad("temperature", "must be a number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 disables it)")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "must be an integer or None")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", f"entry {t!r} is not a token id")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_sorting(self) -> bool:
        """Whether top-k or top-p filtering is active (they need a sorted vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)
