"""A request's state as it moves through the engine, and what the user gets back."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from compiled_spec.sampling_params import SamplingParams
from compiled_spec.spec.metrics import SpecStats


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


# Identity equality: the scheduler finds requests in its queues by ``in`` / ``remove``, and the
# generated field-by-field __eq__ (token lists included) made that a quarter of the host time
# of a batch-512 step.
@dataclass(eq=False)
class Request:
    req_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # the user's seed, or one drawn from the engine's seed
    max_total_tokens: int  # min(prompt + max_tokens, max_model_len)
    prompt: str | None = None
    # Positions a step may write KV for: max_total_tokens plus the engine's lookahead, within
    # max_model_len (0: max_total_tokens). A chain near its end still verifies its full k, so
    # the step keeps the batch's common shape (the graphed early propose, the verify launched
    # ahead); what it accepts past max_total_tokens is never emitted (``LLMEngine._run``).
    kv_limit: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)  # logprobs requested
    num_computed: int = 0  # tokens whose KV is in the cache
    draft_computed: int = 0  # positions whose draft KV is valid (speculative engines)
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache (not computed)
    num_registered: int = 0  # leading blocks registered in the prefix cache
    last_block_hash: object = None  # hash of the last registered block's key (the chain)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    error: str | None = None
    # In a step that raised with other requests: retried alone on its next step, so a fault is
    # pinned on the request that causes it (engine.py, _fault).
    suspect: bool = False
    spec_enabled: bool = False  # drafted and verified (False: plain decoding in the same batch)
    spec_stats: SpecStats | None = None  # per-request acceptance, in speculative engines
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))

    def __post_init__(self) -> None:
        if self.kv_limit < self.max_total_tokens:
            self.kv_limit = self.max_total_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole sequence (a step reads a few
        tokens of every running request; concatenating each request's full history cost
        O(context) per request per step)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    error: str | None = None
    index: int = 0  # which of the prompt's n completions
    logprobs: list[dict[int, float]] | None = None  # per token, when SamplingParams.logprobs


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    spec_stats: SpecStats | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
