"""When to speculate: a per-step choice between drafting and plain decoding (and, given smaller
draft counts, how many drafts to verify), from measured step costs and measured acceptance (pure
logic, no tensors; tested on the CPU).

Speculation pays when the tokens it emits per step outrun its extra cost: at batch B a drafting
step emits B * tau tokens in ``cost_spec`` seconds and a plain step B tokens in ``cost_plain``,
so drafting wins iff ``tau / cost_spec > 1 / cost_plain``. Both sides move with the batch size
(verifying k+1 rows per request turns compute-bound at large batch) and with the prompts (tau),
so they are measured, per batch-size bucket (powers of two), as exponential moving averages of
the engine's own steady-state steps: a step counts for a mode only when it ran that mode
throughout (verified drafts and drafted again, or neither), without prompt tokens.

k shrinks (``SpecConfig.adaptive_k``): a mode ``shrunk(w)`` verifies only the first w of the k
drafts. Verifying k + 1 rows per request turns compute-bound first at large batch on a large
target, where w + 1 rows cost less while the drafts past w are the least likely to be accepted.
Each such mode's step cost is measured like the others'; given the engine's k, every drafting
mode's tau comes from the acceptance per draft position (``observe_acceptance``), so all of them
are judged on the same prompts. The best of all wins.

Output never depends on the choice: a plain step verifies nothing, a drafting step's drafts go
through exact verification. A paused engine still runs the draft's first pass over the accepted
token (no drafting), so the draft's KV stays complete and acceptance is intact on resume.

Coming back from a pause: acceptance belongs to the text, costs to the batch size. While
paused, nothing updates the acceptance estimate but the probes. At batch 1 on the H100
(forty-third session, shipped head, MT-bench) the adaptive engine paused 13.5% of its steps,
in runs of 32 and more, and ran 0.96x of always drafting: a stretch the draft could not
predict turned the bucket to plain decoding, and with a probe every 256 steps it stayed there
long after. So a bucket that turns to plain decoding probes drafting ``probe_first`` steps
later, then twice as far each time, up to ``probe_every``. In a simulation of requests whose
acceptance comes and goes (profiles/scripts/policy_sim_cpu.py: stretches of 40 steps where
the draft fails) that took 1.67 tokens/ms to 2.25, where always drafting makes 2.32; a random
head loses 0.1%. A probe's loss is its drafting steps' extra cost over plain ones, which
grows with the batch (H100, forty-third session: 1.145 vs 0.815 ms at batch 1, 2.0 vs 1.03
at 64), while what a recovery wins shrinks with it (1.8x vanilla at batch 1, 1.07x at 64):
so where a drafting step costs more than ``1 + probe_cost_ref`` plain ones, both intervals
stretch in proportion (forty-sixth session). And once the requests admitted since the last
drafting step make up half the batch (``admitted``), a paused bucket probes its best drafting
mode at once, its acceptance estimate weighing as one sample: the new requests' own
acceptance decides. Those probes back off while they keep losing (``fresh_backoff``): the 1st,
2nd, 4th, 8th ... such admission is probed, and a probe that turns the bucket to drafting
starts the count again. The forty-fifth session's random head at batch 1 (H100) drafted 290
of 5,152 steps, 100 of them in probes of its 20 requests, at 1.545 ms a drafting step against 0.779 plain. In the
simulation (``policy_sim_cpu.py --ab --seeds 12``) the two changes took that random head from
1.245 to 1.274 tokens/ms (vanilla 1.290), at batch 64 a random head from 57.98 to 58.48 (vanilla
62.14) and one whose acceptance comes and goes from 66.99 to 67.61; batch-1 requests whose
acceptance comes and goes moved by +0.6% (bad stretches of 40 steps) to -3.2% (150 steps).
Opt-in (``SpecConfig.cut_losing_probes``: in the engine it did not pay, forty-fifth session),
a probe of drafting in a paused bucket ends early once its own verifications have tried
``probe_trials`` first drafts and show drafting losing to plain decoding: at batch 64 one
verification tries 64, and each drafting step there costs about two plain ones (H100,
forty-third session: 2.2 vs 1.0 ms; 89 drafted steps of a random head's 1,584, most of them
probes of 5 steps that the first verification had already decided). At batch 1 a probe never
gathers that many, so it runs its length.

Exploration: a bucket starts by drafting until ``warmup`` steps are measured, then measures
each shrunk k and plain steps as long, then follows the best mode, and every ``probe_every``
steps runs ``probe_len`` steps of another one (in turn) so its estimate follows drifting
acceptance. A bucket first met after another has been measured starts from that neighbour's
estimates (as one sample each) and measures only ``seed_warmup`` steps of each mode itself: a
batch run passes through several buckets as its requests finish, and a full warm-up in each
made exploration 8-15% of the steps of a 256-token run on the H200 (eighteenth session); each
shrunk k adds its own steps to that. Estimates are running means until a mode has 1 /
``alpha`` samples, exponential moving averages after (a seed weighs as one sample); step costs
take the median of those first samples instead of their mean, since a mode's first steps can
run several times slower than its steady state (on the H100, thirty-fourth session, one engine
estimated a drafting step at 2.37 ms against 1.26 ms in its twin of the same process, and chose
the wrong mode from it).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

SPEC, PLAIN = "spec", "plain"
MAX_STRETCH = 8.0  # the most a paused bucket's probe intervals stretch (a bad estimate's bound)
_SHRUNK = "spec_k"


def shrunk(k: int) -> str:
    """The mode that verifies ``k`` drafts, fewer than the engine's own (k shrinks)."""
    return f"{_SHRUNK}{k}"


def mode_k(mode: str, k: int) -> int:
    """Drafts the next step verifies after a step of ``mode`` in an engine of ``k`` (0: plain)."""
    if mode == PLAIN:
        return 0
    return k if mode == SPEC else int(mode[len(_SHRUNK):])


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
class _Cost(_Ema):
    """A step cost: the median of the first 1 / alpha samples, an EMA from there on."""

    first: list[float] = field(default_factory=list)

    def add(self, x: float, alpha: float) -> None:
        if self.count < round(1.0 / alpha):
            self.first.append(x)
            self.count += 1
            self.value = statistics.median(self.first)
        else:
            super().add(x, alpha)


@dataclass
class _Bucket:
    modes: tuple[str, ...]
    cost: dict[str, _Cost] = field(default_factory=dict)
    tau: dict[str, _Ema] = field(default_factory=dict)  # tokens per request per drafting step
    steps: int = 0  # decisions taken in this bucket
    probe_left: int = 0  # steps of the probed mode still to run in the current probe
    probe_mode: str = PLAIN
    probes: int = 0
    fresh_probes: int = 0  # of the probes: those new requests started (``SpecPolicy.admitted``)
    # While paused: admissions that would start a probe of their own, the count at which the
    # next one does (1, 2, 4, ...; back to 1 once drafting wins), and those passed over
    fresh_seen: int = 0
    fresh_due: int = 1
    fresh_skipped: int = 0
    cut_probes: int = 0  # probes of drafting ended early: their own verifications decided
    # The current probe's own verifications, per draft position j - 1: requests that verified
    # >= j drafts, and of them those that accepted >= j
    probe_seen: list[int] = field(default_factory=list)
    probe_hit: list[int] = field(default_factory=list)
    paused: bool = False  # plain decoding is its best mode (probes back off while so)
    interval: int = 0  # steps from one probe of drafting to the next while plain is best
    next_probe: int = 0
    chosen: dict[str, int] = field(default_factory=dict)
    need: int = 0  # samples of each mode (a seed included) before the modes are compared
    seeded_from: int | None = None  # the neighbour bucket its estimates started from
    # [j - 1]: the share of requests accepting >= j drafts, among those that verified >= j
    accept: list[_Ema] = field(default_factory=list)

    def __post_init__(self) -> None:
        for m in self.modes:
            self.cost.setdefault(m, _Cost())
            self.chosen.setdefault(m, 0)
            if m != PLAIN:
                self.tau.setdefault(m, _Ema())

    def measured(self) -> bool:
        return all(self.cost[m].count >= self.need for m in self.modes)


@dataclass
class SpecPolicy:
    """``mode(batch_size)`` before a step's proposal; ``observe(...)`` after each step."""

    warmup: int = 8  # measured steps of each mode before comparing
    probe_every: int = 256  # steps between probes of a mode not chosen
    probe_len: int = 4  # a probe's length (one more step switches modes and is not measured)
    # Paused: the first probe of drafting this many steps after the bucket turned to plain
    # decoding, each next one twice as far, up to probe_every (see the module docstring)
    probe_first: int = 8
    # Paused: the extra cost of a drafting step over a plain one (cost_spec / cost_plain - 1) at
    # which probe_first and probe_every hold as given; a bucket whose drafting costs more
    # relative to plain decoding stretches both in proportion (see the module docstring)
    probe_cost_ref: float = 0.4
    # Paused: new requests are probed at their 1st, 2nd, 4th, ... admission-triggered chance
    # while those probes keep losing (``_admission_probe``); False: every time
    fresh_backoff: bool = True
    # A drafting probe in a paused bucket ends once it has verified this many first drafts and
    # its own acceptance loses to plain decoding (see the module docstring)
    probe_trials: int | None = 16  # None: probes run their length
    alpha: float = 0.1  # EMA weight of a new observation
    seed_warmup: int = 2  # own steps of each mode in a bucket seeded from a measured neighbour
    # The modes compared, explored in this order: SPEC (k drafts), then any ``shrunk(w)``, PLAIN
    modes: tuple[str, ...] = (SPEC, PLAIN)
    # The engine's k: with it, a drafting mode's tau is estimated from the acceptance per draft
    # position (``observe_acceptance``) where that covers its drafts; 0: from its own steps.
    k: int = 0
    buckets: dict[int, _Bucket] = field(default_factory=dict)
    # requests admitted since the last drafting step (``admitted``)
    fresh: int = 0

    def __post_init__(self) -> None:
        for name in ("warmup", "probe_every", "probe_len", "seed_warmup", "probe_first",
                     "probe_trials"):
            v = getattr(self, name)
            if name == "probe_trials" and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha={self.alpha!r}: must be in (0, 1]")
        if not isinstance(self.fresh_backoff, bool):
            raise ValueError(f"fresh_backoff={self.fresh_backoff!r}: must be a bool")
        if isinstance(self.probe_cost_ref, bool) or not self.probe_cost_ref > 0:
            raise ValueError(f"probe_cost_ref={self.probe_cost_ref!r}: must be > 0")
        modes = tuple(self.modes)
        if (len(set(modes)) != len(modes) or SPEC not in modes or PLAIN not in modes
                or any(m not in (SPEC, PLAIN) and not m.startswith(_SHRUNK) for m in modes)):
            raise ValueError(f"modes={modes!r}: expected SPEC, PLAIN and shrunk(k) modes, "
                             "each once")
        self.modes = modes
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 0:
            raise ValueError(f"k={self.k!r}: must be an integer >= 0")

    def _bucket(self, batch_size: int) -> _Bucket:
        size = bucket_of(batch_size)
        b = self.buckets.get(size)
        if b is None:
            b = self.buckets[size] = self._new_bucket(size)
        return b

    def _new_bucket(self, size: int) -> _Bucket:
        """Full warm-up, or the nearest measured bucket's estimates as one sample each."""
        measured = [s for s, o in self.buckets.items() if o.measured()]
        if not measured:
            return _Bucket(self.modes, need=self.warmup)
        near = min(measured, key=lambda s: (abs(s.bit_length() - size.bit_length()), s))
        src = self.buckets[near]
        b = _Bucket(self.modes, need=self.seed_warmup + 1, seeded_from=near)
        for mode in self.modes:
            c = src.cost[mode].value
            b.cost[mode] = _Cost(c, 1, [c])
            if mode != PLAIN:
                b.tau[mode] = _Ema(src.tau[mode].value, 1)
        b.accept = [_Ema(e.value, 1) for e in src.accept]
        return b

    def tau(self, b: _Bucket, mode: str) -> float:
        """Estimated tokens per request of a step of ``mode``. A drafting mode of w drafts:
        1 + the sum over positions j <= w of P(a request accepts >= j), from every step that
        verified that far (a shrunk mode's own steps never see the positions past w, and its
        tau measured on its own steps alone moved with whichever prompts ran then: on the CPU,
        thirty-fourth session, 2.33 for 2 drafts against 2.11 for 5 in one run and 1.75 for 2
        in the next); else its own steps' mean."""
        if mode == PLAIN:
            return 1.0
        w = mode_k(mode, self.k) if self.k else 0
        if 0 < w <= len(b.accept) and all(e.count for e in b.accept[:w]):
            return 1.0 + sum(e.value for e in b.accept[:w])
        return b.tau[mode].value

    def _tau_seen(self, b: _Bucket, mode: str) -> float | None:
        """``tau`` once anything informs it (its own steps, or any verification), else None."""
        return self.tau(b, mode) if b.tau[mode].count or b.accept else None

    def rate(self, b: _Bucket, mode: str) -> float:
        """Estimated tokens per second per request of ``mode`` in ``b``."""
        return self.tau(b, mode) / max(b.cost[mode].value, 1e-12)

    def better(self, b: _Bucket) -> str:
        """The mode with the most tokens per second per request, from the estimates (the first
        in ``modes`` order on a tie: drafting k before fewer, fewer before none)."""
        return max(self.modes, key=lambda m: self.rate(b, m))

    def mode(self, batch_size: int) -> str:
        """The mode of the step about to propose for ``batch_size`` requests: draft k (SPEC),
        draft to verify fewer (a ``shrunk`` mode), or not (PLAIN)."""
        b = self._bucket(batch_size)
        b.steps += 1
        m = next((m for m in self.modes if b.cost[m].count < b.need), None)  # warm-up
        if m is None:
            best = self.better(b)
            if best != PLAIN:
                b.paused, b.fresh_seen, b.fresh_due = False, 0, 1
                due = b.steps % self.probe_every == 0
            else:
                if not b.paused:  # just turned: acceptance may come back soon
                    b.paused, b.interval = True, round(self.probe_first * self._stretch(b))
                    b.next_probe = b.steps + b.interval
                due = b.steps >= b.next_probe
                if b.probe_left > 0 and b.probe_mode != PLAIN and self._probe_lost(b):
                    b.probe_left = 0
                    b.cut_probes += 1
            if best == PLAIN and b.probe_left == 0 and 2 * self.fresh >= batch_size:
                self._admission_probe(b)
            elif b.probe_left == 0 and due:
                if best == PLAIN:
                    b.interval = min(2 * b.interval, round(self.probe_every * self._stretch(b)))
                    b.next_probe = b.steps + b.interval
                others = [o for o in self.modes if o != best]
                self._start_probe(b, others[b.probes % len(others)])
            if b.probe_left > 0:
                b.probe_left -= 1
                m = b.probe_mode
            else:
                m = best
        b.chosen[m] += 1
        if m != PLAIN:
            self.fresh = 0  # their acceptance is observed now
        return m

    def _stretch(self, b: _Bucket) -> float:
        """How much farther apart a paused bucket's probes of drafting go than as configured:
        a probe's loss grows with its drafting steps' extra cost over plain ones (the cheapest
        drafting mode's, relative; 1 at or below ``probe_cost_ref``, at most MAX_STRETCH)."""
        plain = max(b.cost[PLAIN].value, 1e-12)
        extra = min(b.cost[m].value for m in self.modes if m != PLAIN) / plain - 1.0
        return min(MAX_STRETCH, max(1.0, extra / self.probe_cost_ref))

    def admitted(self, n: int) -> None:
        """``n`` requests joined the running batch (their prompts run in this step)."""
        self.fresh += n

    def _admission_probe(self, b: _Bucket) -> None:
        """New requests make up half the batch of a paused bucket: probe them, unless the
        bucket's probes of new requests keep losing (each one that did not turn the bucket
        doubles the admissions passed over until the next; the forty-fifth session's random
        head at batch 1 drafted 100 of its 290 drafted steps in probes of its 20 requests)."""
        b.fresh_seen += 1
        if not self.fresh_backoff or b.fresh_seen >= b.fresh_due:
            b.fresh_due *= 2
            self._probe_fresh(b)
        else:
            self.fresh = 0  # passed over: their acceptance is left to the scheduled probes
            b.fresh_skipped += 1

    def _probe_fresh(self, b: _Bucket) -> None:
        """Probe ``b``'s best drafting mode now, the acceptance estimate kept as one sample."""
        for e in (*b.accept, *b.tau.values()):
            e.count = min(e.count, 1)
        self._start_probe(b, max((m for m in self.modes if m != PLAIN),
                                 key=lambda m: self.rate(b, m)))
        b.fresh_probes += 1

    def _start_probe(self, b: _Bucket, mode: str) -> None:
        b.probe_mode = mode
        b.probes += 1
        b.probe_left = self.probe_len + 1  # + the switching step, not measured
        b.probe_seen, b.probe_hit = [], []

    def _probe_lost(self, b: _Bucket) -> bool:
        """The running drafting probe has tried ``probe_trials`` first drafts, and the tau of
        its own verifications makes its mode slower than plain decoding."""
        if (self.probe_trials is None or not b.probe_seen
                or b.probe_seen[0] < self.probe_trials):
            return False
        w = mode_k(b.probe_mode, self.k) if self.k else len(b.probe_seen)
        tau = 1.0 + sum(h / n for n, h in zip(b.probe_seen[:w], b.probe_hit[:w]) if n)
        return tau / max(b.cost[b.probe_mode].value, 1e-12) < self.rate(b, PLAIN)

    def observe(self, batch_size: int, mode: str, seconds: float, tokens_per_request: float
                ) -> None:
        """A steady-state step of ``mode`` (the caller leaves out steps with prompt tokens and
        steps that switched modes): its wall time and the tokens each request emitted."""
        b = self._bucket(batch_size)
        b.cost[mode].add(seconds, self.alpha)
        if mode != PLAIN:
            b.tau[mode].add(tokens_per_request, self.alpha)

    def observe_acceptance(self, batch_size: int, num_draft: list[int],
                           num_accepted: list[int]) -> None:
        """A step's verification, any step that verified drafts: per request, the drafts it
        verified and how many of them it accepted."""
        b = self._bucket(batch_size)
        # Counts per value, then suffix sums: one pass over the batch (it runs every step), not
        # one per position. Accepted <= verified, so "accepted >= j" implies "verified >= j".
        top = max(num_draft, default=0)
        verified, accepted = [0] * (top + 1), [0] * (top + 1)
        for d, a in zip(num_draft, num_accepted):
            verified[d] += 1
            accepted[a] += 1
        while len(b.accept) < top:
            b.accept.append(_Ema())
        probing = b.probe_left > 0 and b.probe_mode != PLAIN
        if probing:
            grow = top - len(b.probe_seen)
            b.probe_seen += [0] * grow
            b.probe_hit += [0] * grow
        tried = hit = 0
        for j in range(top, 0, -1):
            tried, hit = tried + verified[j], hit + accepted[j]
            b.accept[j - 1].add(hit / tried, self.alpha)
            if probing:
                b.probe_seen[j - 1] += tried
                b.probe_hit[j - 1] += hit

    def summary(self) -> dict[int, dict[str, Any]]:
        """Per bucket: steps drafted / paused, the estimates (ms, tau), the mode preferred;
        with shrunk modes, theirs under "shrunk" (steps, step ms, tau)."""
        out: dict[int, dict[str, Any]] = {}
        for size, b in sorted(self.buckets.items()):
            out[size] = {
                "drafted_steps": sum(n for m, n in b.chosen.items() if m != PLAIN),
                "paused_steps": b.chosen[PLAIN],
                "spec_step_ms": _ms(b.cost[SPEC]), "plain_step_ms": _ms(b.cost[PLAIN]),
                "tau": self._tau_seen(b, SPEC),
                "prefers": self.better(b) if b.measured() else None,
                "seeded_from": b.seeded_from,
                "probes": b.probes, "fresh_probes": b.fresh_probes,
                "fresh_skipped": b.fresh_skipped,
                "cut_probes": b.cut_probes,
            }
            shrunk_modes = [m for m in self.modes if m not in (SPEC, PLAIN)]
            if shrunk_modes:
                out[size]["shrunk"] = {m: {"steps": b.chosen[m], "step_ms": _ms(b.cost[m]),
                                           "tau": self._tau_seen(b, m)}
                                       for m in shrunk_modes}
        return out


def _ms(e: _Ema) -> float | None:
    return 1e3 * e.value if e.count else None
