"""When to speculate: a per-step choice between drafting and plain decoding, from measured
step costs and measured acceptance (pure logic, no tensors; tested on the CPU).

Speculation pays when the tokens it emits per step outrun its extra cost: at batch B a drafting
step emits B * tau tokens in ``cost_spec`` seconds and a plain step B tokens in ``cost_plain``,
so drafting wins iff ``tau / cost_spec > 1 / cost_plain``. Both sides move with the batch size
(verifying k+1 rows per request turns compute-bound at large batch) and with the prompts (tau),
so they are measured, per batch-size bucket (powers of two), as exponential moving averages of
the engine's own steady-state steps: a step counts for a mode only when it ran that mode
throughout (verified drafts and drafted again, or neither), without prompt tokens.

Output never depends on the choice: a plain step verifies nothing, a drafting step's drafts go
through exact verification. A paused engine still runs the draft's first pass over the accepted
token (no drafting), so the draft's KV stays complete and acceptance is intact on resume.

Exploration: a bucket starts by drafting until ``warmup`` steps are measured, then measures
plain steps as long, then follows the better mode, and every ``probe_every`` steps runs
``probe_len`` steps of the other one so its estimate follows drifting acceptance. A bucket first
met after another has been measured starts from that neighbour's estimates (as one sample each)
and measures only ``seed_warmup`` steps of each mode itself: a batch run passes through several
buckets as its requests finish, and a full warm-up in each made exploration 8-15% of the steps
of a 256-token run on the H200 (eighteenth session). Estimates are running means until a mode
has 1 / ``alpha`` samples, exponential moving averages after (a seed weighs as one sample).
"""
from __future__ import annotations

from dataclasses import dataclass, field

SPEC, PLAIN = "spec", "plain"


def bucket_of(batch_size: int) -> int:
    """Power-of-two bucket of a batch size (1, 2, 4, ...)."""
    return 1 if batch_size <= 1 else 1 << (batch_size - 1).bit_length()


@dataclass
class _Ema:
    value: float = 0.0
    count: int = 0

    def add(self, x: float, alpha: float) -> None:
        a = max(alpha, 1.0 / (self.count + 1))  # a running mean first: no weight on the start
        self.value = (1 - a) * self.value + a * x
        self.count += 1


@dataclass
class _Bucket:
    cost: dict[str, _Ema] = field(default_factory=lambda: {SPEC: _Ema(), PLAIN: _Ema()})
    tau: _Ema = field(default_factory=_Ema)  # tokens emitted per request per drafting step
    steps: int = 0  # decisions taken in this bucket
    probe_left: int = 0  # steps of the other mode still to run in the current probe
    chosen: dict[str, int] = field(default_factory=lambda: {SPEC: 0, PLAIN: 0})
    need: int = 0  # samples of each mode (a seed included) before the modes are compared
    seeded_from: int | None = None  # the neighbour bucket its estimates started from


@dataclass
class SpecPolicy:
    """``mode(batch_size)`` before a step's proposal; ``observe(...)`` after each step."""

    warmup: int = 8  # measured steps of each mode before comparing
    probe_every: int = 256  # steps between probes of the mode not chosen
    probe_len: int = 4  # a probe's length (one more step switches modes and is not measured)
    alpha: float = 0.1  # EMA weight of a new observation
    seed_warmup: int = 2  # own steps of each mode in a bucket seeded from a measured neighbour
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("warmup", "probe_every", "probe_len", "seed_warmup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha={self.alpha!r}: must be in (0, 1]")

    def _bucket(self, batch_size: int) -> _Bucket:
        size = bucket_of(batch_size)
        b = self.buckets.get(size)
        if b is None:
            b = self.buckets[size] = self._new_bucket(size)
        return b

    def _new_bucket(self, size: int) -> _Bucket:
        """Full warm-up, or the nearest measured bucket's estimates as one sample each."""
        measured = [s for s, o in self.buckets.items()
                    if o.cost[SPEC].count >= o.need and o.cost[PLAIN].count >= o.need]
        if not measured:
            return _Bucket(need=self.warmup)
        near = min(measured, key=lambda s: (abs(s.bit_length() - size.bit_length()), s))
        src = self.buckets[near]
        b = _Bucket(need=self.seed_warmup + 1, seeded_from=near)
        for mode in (SPEC, PLAIN):
            b.cost[mode] = _Ema(src.cost[mode].value, 1)
        b.tau = _Ema(src.tau.value, 1)
        return b

    def better(self, b: _Bucket) -> str:
        """The mode with more tokens per second per request, from the estimates."""
        spec_rate = b.tau.value / max(b.cost[SPEC].value, 1e-12)
        plain_rate = 1.0 / max(b.cost[PLAIN].value, 1e-12)
        return SPEC if spec_rate >= plain_rate else PLAIN

    def mode(self, batch_size: int) -> str:
        """Draft (SPEC) or not (PLAIN) in the step about to propose for ``batch_size`` requests."""
        b = self._bucket(batch_size)
        b.steps += 1
        if b.cost[SPEC].count < b.need:
            m = SPEC
        elif b.cost[PLAIN].count < b.need:
            m = PLAIN
        else:
            best = self.better(b)
            if b.probe_left == 0 and b.steps % self.probe_every == 0:
                b.probe_left = self.probe_len + 1  # + the switching step, not measured
            if b.probe_left > 0:
                b.probe_left -= 1
                m = PLAIN if best == SPEC else SPEC
            else:
                m = best
        b.chosen[m] += 1
        return m

    def observe(self, batch_size: int, mode: str, seconds: float, tokens_per_request: float
                ) -> None:
        """A steady-state step of ``mode`` (the caller leaves out steps with prompt tokens and
        steps that switched modes): its wall time and the tokens each request emitted."""
        b = self._bucket(batch_size)
        b.cost[mode].add(seconds, self.alpha)
        if mode == SPEC:
            b.tau.add(tokens_per_request, self.alpha)

    def summary(self) -> dict[int, dict[str, float | int | None]]:
        """Per bucket: steps drafted / paused, the estimates (ms, tau), the mode preferred."""
        out: dict[int, dict[str, float | int | None]] = {}
        for size, b in sorted(self.buckets.items()):
            measured = all(b.cost[m].count >= b.need for m in (SPEC, PLAIN))
            out[size] = {
                "drafted_steps": b.chosen[SPEC], "paused_steps": b.chosen[PLAIN],
                "spec_step_ms": 1e3 * b.cost[SPEC].value if b.cost[SPEC].count else None,
                "plain_step_ms": 1e3 * b.cost[PLAIN].value if b.cost[PLAIN].count else None,
                "tau": b.tau.value if b.tau.count else None,
                "prefers": self.better(b) if measured else None,
                "seeded_from": b.seeded_from,
            }
        return out
