"""Per-request sampling parameters, validated on construction and again when a request is added
(a SamplingParams mutated after construction is re-checked; the engine keeps its own copy)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

# Seeds and token ids travel to the device as int64; top_k is compared with int64 ranks. A value
# that does not fit failed deep inside a step ("Overflow when unpacking long long"), so the range
# is checked here. top_k above the vocabulary keeps every token, so 2**31 - 1 loses nothing.
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1
TOP_K_MAX = 2 ** 31 - 1
LOGPROBS_MAX = 20  # per-token alternatives in logprobs (vLLM's default max_logprobs)
N_MAX = 1024  # completions per prompt; each is a request with its own KV


def sub_seed(seed: int | None, i: int) -> int | None:
    """The seed of completion ``i`` of an ``n > 1`` request: the seed itself for i = 0 (so
    n = 1 and the first of n agree), a 64-bit mix of (seed, i) for the others, kept in the
    int64 range; None stays None (the engine draws a seed per request)."""
    if seed is None or i == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + i * 0xBF58476D1CE4E5B9) & (2 ** 64 - 1)
    x ^= x >> 31
    return x - 2 ** 64 if x >= 2 ** 63 else x


def as_int(v: object) -> int | None:
    """``v`` as a Python int when it is an integer (numpy integers included), else None.
    Booleans are not numbers here: ``True`` as a token id or a top_k is a bug in the caller."""
    if type(v) is int:  # nearly always: no ABC check (~1 us each, a dozen per request)
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        return None
    return int(v)


def as_real(v: object) -> float | None:
    """``v`` as a float when it is a real number (numpy scalars included, not a bool), else None."""
    t = type(v)
    if t is float or t is int:
        return float(v)
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    return float(v)


@dataclass
class SamplingParams:
    """What a user asks of one request. ``temperature == 0`` means greedy decoding.

    ``seed`` makes a request reproducible on its own: its random draws depend only on the seed and
    the position of the token being sampled, never on the other requests in the batch. It must fit
    a signed 64-bit integer: ``-2**63 <= seed < 2**63``. ``top_k`` is 0 (off) to ``2**31 - 1``.
    """

    max_tokens: int = 64
    n: int = 1  # completions per prompt (each its own request; seeds derived, see sub_seed)
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    # Stop strings: the output stops once its text contains one; the text returned ends before
    # it (engine/stopping.py). A single string is one stop string.
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    speculate: bool = True  # False: this request decodes plainly even in a speculative engine
    # Per-token log-probabilities: None = off, k >= 0 = the emitted token's plus the k most
    # likely (engine/logprobs.py), in CompletionOutput.logprobs.
    logprobs: int | None = None
    # False: the output's text is left empty, token ids only (vLLM's SamplingParams.detokenize):
    # self-distillation never reads it, and decoding each output cost it ~0.1 ms of host time
    # per request. Stop strings are matched on the text, so they need it. Last field, so
    # positional arguments keep their order.
    detokenize: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalise: numpy scalars to Python numbers, None stop ids to []) every
        field; raises ValueError naming the bad one."""
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        mt = as_int(self.max_tokens)
        if mt is None:
            raise bad("max_tokens", "must be an integer")
        if mt < 1:
            raise bad("max_tokens", "must be at least 1")
        self.max_tokens = mt
        n = as_int(self.n)
        if n is None or not 1 <= n <= N_MAX:
            raise bad("n", f"must be an integer in [1, {N_MAX}]")
        self.n = n
        t = as_real(self.temperature)
        if t is None or not math.isfinite(t):
            raise bad("temperature", "must be a finite number")
        if t < 0:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        self.temperature = t
        k = as_int(self.top_k)
        if k is None or not 0 <= k <= TOP_K_MAX:
            raise bad("top_k", f"must be an integer in [0, {TOP_K_MAX}] (0 disables it)")
        self.top_k = k
        p = as_real(self.top_p)
        if p is None or not 0.0 < p <= 1.0:
            raise bad("top_p", "must be a number in (0, 1]")
        self.top_p = p
        m = as_real(self.min_p)
        if m is None or not 0.0 <= m <= 1.0:
            raise bad("min_p", "must be a number in [0, 1]")
        self.min_p = m
        if self.seed is not None:
            s = as_int(self.seed)
            if s is None or not SEED_MIN <= s <= SEED_MAX:
                raise bad("seed", "must be None or an integer in [-2**63, 2**63) (it is an int64 "
                          "on the device)")
            self.seed = s
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids,
                                                                        "__iter__"):
            raise bad("stop_token_ids", "must be a list of token ids")
        ids = []
        for v in self.stop_token_ids:
            i = as_int(v)
            if i is None or not 0 <= i <= SEED_MAX:
                raise bad("stop_token_ids", f"entry {v!r} is not a token id")
            ids.append(i)
        self.stop_token_ids = ids
        if self.logprobs is not None:
            lp = as_int(self.logprobs)
            if lp is None or not 0 <= lp <= LOGPROBS_MAX:
                raise bad("logprobs", f"must be None or an integer in [0, {LOGPROBS_MAX}]")
            self.logprobs = lp
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(
                isinstance(x, str) and x for x in self.stop):
            raise bad("stop", "must be a string or a list of non-empty strings")
        self.stop = list(self.stop)
        for f in ("ignore_eos", "skip_special_tokens", "detokenize", "speculate"):
            if not isinstance(getattr(self, f), bool):
                raise bad(f, "must be True or False")
        if self.stop and not self.detokenize:
            raise bad("detokenize", f"stop strings {self.stop!r} are matched on the decoded "
                      "output: they need detokenize=True")

    def checked_copy(self) -> "SamplingParams":
        """A re-validated copy: what the engine keeps, so a mutation before ``generate`` is
        checked and one during it never reaches a running request. Shallow, then validated:
        ``validate`` builds the list fields anew, so the copy shares nothing mutable with
        ``self`` (``dataclasses.replace`` did the same through ``__init__`` at ~3x the cost)."""
        c = object.__new__(type(self))  # copy.copy's reduce protocol: ~2x this
        c.__dict__.update(self.__dict__)
        c.validate()
        return c

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_sorting(self) -> bool:
        """Whether top-k or top-p filtering is active (they need a sorted vocabulary)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)
