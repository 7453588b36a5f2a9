"""speculation_policy="adaptive": the per-step choice between drafting and plain decoding
(pure policy), its output against vanilla, and the draft KV it keeps complete while paused."""
import pytest
import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.spec.policy import (MAX_STRETCH, PLAIN, SPEC, SpecPolicy, bucket_of, mode_k,
                                       shrunk)
from tests.policy_stub import ModesInTurn
from tests.spec_models import write_bigram_target, write_mirror_eagle1


def _drive(policy: SpecPolicy, batch: int, steps: int, cost: dict[str, float], tau: float
           ) -> list[str]:
    """Run ``steps`` decisions at ``batch`` with fixed per-mode costs; every step is steady."""
    modes = []
    for _ in range(steps):
        m = policy.mode(batch)
        policy.observe(batch, m, cost[m], tau if m == SPEC else 1.0)
        modes.append(m)
    return modes


def test_policy_explores_both_modes_then_keeps_the_faster():
    p = SpecPolicy(warmup=4, probe_every=1000, probe_first=1000)
    modes = _drive(p, 1, 40, {SPEC: 1.5e-3, PLAIN: 1.0e-3}, tau=2.5)  # 1.67 vs 1.0 tokens/ms
    assert modes[:8] == [SPEC] * 4 + [PLAIN] * 4 and set(modes[8:]) == {SPEC}
    p = SpecPolicy(warmup=4, probe_every=1000, probe_first=1000)
    modes = _drive(p, 64, 40, {SPEC: 3.0e-3, PLAIN: 1.0e-3}, tau=2.5)  # 0.83 vs 1.0
    assert modes[:8] == [SPEC] * 4 + [PLAIN] * 4 and set(modes[8:]) == {PLAIN}
    s = p.summary()[64]
    assert s["prefers"] == PLAIN and s["paused_steps"] == 36 and s["drafted_steps"] == 4
    assert s["spec_step_ms"] == pytest.approx(3.0) and s["tau"] == pytest.approx(2.5)


def test_policy_probes_the_other_mode_and_follows_a_change():
    p = SpecPolicy(warmup=2, probe_every=16, probe_len=2, alpha=0.5)
    modes = _drive(p, 8, 63, {SPEC: 1.5e-3, PLAIN: 1.0e-3}, tau=2.5)
    # after warm-up, 3 plain steps (the probe and its switch) from every 16th decision
    assert [i for i, m in enumerate(modes) if m == PLAIN and i >= 4] == [
        15, 16, 17, 31, 32, 33, 47, 48, 49]
    # acceptance collapses: the next probes' estimates turn the choice to plain decoding
    modes = _drive(p, 8, 64, {SPEC: 1.5e-3, PLAIN: 1.0e-3}, tau=1.0)
    assert modes[-16:].count(PLAIN) >= 13


def _paused_run(p: SpecPolicy, steps: int, accepted: int, spec_cost: float = 1.5e-3
                ) -> list[str]:
    """Batch-1 steps of 3 drafts each accepting ``accepted``, as the engine reports them:
    a drafting step's verification, and its cost when the step before ran the same mode."""
    out, prev = [], None
    for _ in range(steps):
        m = p.mode(1)
        if m == SPEC:
            p.observe_acceptance(1, [3], [accepted])
        if m == prev:
            p.observe(1, m, spec_cost if m == SPEC else 1.0e-3,
                      1.0 + accepted if m == SPEC else 1.0)
        prev = m
        out.append(m)
    return out


def _probe_starts(modes: list[str]) -> tuple[int, list[int]]:
    """The step the bucket turned to plain decoding, and the steps its probes of drafting began."""
    turned = modes.index(PLAIN)
    return turned, [i for i in range(turned, len(modes))
                    if modes[i] == SPEC and modes[i - 1] == PLAIN]


def test_a_paused_bucket_probes_drafting_soon_then_ever_less_often():
    """Acceptance moves within a request (a stretch the draft cannot predict, then text it
    can): after the bucket turns to plain decoding, drafting is probed ``probe_first`` steps
    later, then twice as far each time, up to ``probe_every``; once acceptance is back, the
    next probe finds it and the bucket drafts again. A bucket that drafts probes plain
    decoding only every ``probe_every`` steps."""
    # probe_cost_ref = the drafting step's extra cost (1.5 vs 1.0 ms): the intervals as given
    p = SpecPolicy(warmup=2, probe_every=64, probe_len=2, probe_first=4, alpha=0.5, k=3,
                   probe_cost_ref=0.5)
    assert set(_paused_run(p, 40, accepted=3)[6:]) == {SPEC}  # (after warm-up) drafting pays
    # the draft stops predicting: plain decoding, probes back off
    turned, starts = _probe_starts(_paused_run(p, 150, accepted=0))
    assert starts[0] == turned + 4, (turned, starts)
    assert [b - a for a, b in zip(starts, starts[1:])] == [8, 16, 32, 64], starts
    back = _paused_run(p, 80, accepted=3)  # acceptance is back: the next probe turns it around
    first = back.index(SPEC)
    assert first <= 64 and back[first:].count(PLAIN) <= 3, back  # (a probe of plain at most)
    assert SpecPolicy(probe_first=8).probe_first == 8
    with pytest.raises(ValueError, match="probe_first"):
        SpecPolicy(probe_first=0)


def test_costlier_drafting_stretches_a_paused_buckets_probe_intervals():
    """A probe of drafting in a paused bucket loses its drafting steps' extra cost: where that
    is twice ``probe_cost_ref`` (a drafting step at 3x a plain one's cost, as at batch 64 on a
    small target), the probes go twice as far apart, their cap (``probe_every``) included; at
    or below it they keep the configured intervals."""
    def starts(spec_cost: float, ref: float) -> tuple[int, list[int]]:
        p = SpecPolicy(warmup=2, probe_every=32, probe_len=2, probe_first=4, alpha=0.5, k=3,
                       probe_cost_ref=ref)
        _paused_run(p, 20, accepted=3, spec_cost=spec_cost)
        return _probe_starts(_paused_run(p, 300, accepted=0, spec_cost=spec_cost))

    turned, s = starts(3.0e-3, ref=1.0)  # extra cost 2.0: twice the reference
    assert s[0] == turned + 8 and [b - a for a, b in zip(s, s[1:])][:4] == [16, 32, 64, 64], s
    turned, s = starts(3.0e-3, ref=2.0)  # at the reference: as configured
    assert s[0] == turned + 4 and [b - a for a, b in zip(s, s[1:])][:4] == [8, 16, 32, 32], s
    turned, s = starts(1.2e-3, ref=0.5)  # cheaper than the reference: never closer
    assert s[0] == turned + 4, s
    # a drafting step at 1000x (the bucket pauses at once): stretched MAX_STRETCH at most
    _, s = starts(1.0, ref=0.5)
    assert [b - a for a, b in zip(s, s[1:])][:2] == [8 * MAX_STRETCH, 16 * MAX_STRETCH], s
    assert SpecPolicy(probe_cost_ref=0.25).probe_cost_ref == 0.25
    for bad in (0, -1.0, True):
        with pytest.raises(ValueError, match="probe_cost_ref"):
            SpecPolicy(probe_cost_ref=bad)


def _run_steps(p: SpecPolicy, batch: int, steps: int, accepted: int,
               spec_cost: float = 2.0e-3, engine_timing: bool = True) -> list[str]:
    """Drive ``p`` for ``steps`` steps of ``batch`` requests, each accepting ``accepted`` of 3
    drafts. As the engine calls it (``engine_timing``): a step verifies the drafts of the step
    before (if it drafted); else a drafting step's own drafts are verified at once. A step is
    measured when it ran the same mode as the step before."""
    modes: list[str] = []
    prev = None
    for _ in range(steps):
        m = p.mode(batch)
        if (prev if engine_timing else m) not in (None, PLAIN):
            p.observe_acceptance(batch, [3] * batch, [accepted] * batch)
        if m == prev:
            p.observe(batch, m, spec_cost if m == SPEC else 1.0e-3,
                      1.0 + accepted if m == SPEC else 1.0)
        prev = m
        modes.append(m)
    return modes


def _probe_runs(modes: list[str], start: int) -> list[int]:
    """Lengths of the runs of drafting steps after ``start``."""
    runs, n = [], 0
    for m in modes[start:] + [PLAIN]:
        if m == SPEC:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_a_losing_probe_ends_once_its_own_verifications_decide():
    """A drafting step at batch 32 costs two plain ones: a probe of drafting whose first
    verification (32 first drafts tried, none accepted) already loses ends there, two drafted
    steps instead of probe_len + 1. At batch 1 one verification tries one draft: the probe
    runs its length. (probe_cost_ref = the drafting step's extra cost: the intervals as
    configured.) A probe that finds acceptance back is not cut and turns the bucket."""
    p = SpecPolicy(warmup=2, probe_every=64, probe_len=4, probe_first=8, alpha=0.5, k=3,
                   probe_cost_ref=1.0)
    low = _run_steps(p, 32, 140, accepted=0)
    turned = low.index(PLAIN)
    assert _probe_runs(low, turned) == [2, 2, 2, 2], low  # probes at +8, +16, +32, +64
    assert p.summary()[32]["cut_probes"] == 4 and p.summary()[32]["probes"] == 4
    # the same without the cut: every probe drafts probe_len + 1 steps
    q = SpecPolicy(warmup=2, probe_every=64, probe_len=4, probe_first=8, alpha=0.5, k=3,
                   probe_trials=10 ** 6, probe_cost_ref=1.0)
    low_q = _run_steps(q, 32, 140, accepted=0)
    assert _probe_runs(low_q, low_q.index(PLAIN)) == [5, 5, 5, 5]
    assert q.summary()[32]["cut_probes"] == 0
    # batch 1: too few drafts tried within a probe to cut it
    one = SpecPolicy(warmup=2, probe_every=64, probe_len=4, probe_first=8, alpha=0.5, k=3,
                   probe_cost_ref=1.0)
    low_1 = _run_steps(one, 1, 140, accepted=0)
    assert _probe_runs(low_1, low_1.index(PLAIN)) == [5, 5, 5, 5]
    assert one.summary()[1]["cut_probes"] == 0
    # acceptance is back: the next probe is not cut and the bucket drafts again
    back = _run_steps(p, 32, 80, accepted=3)
    first = back.index(SPEC)
    assert back[first:].count(PLAIN) <= 3 and p.summary()[32]["cut_probes"] == 4, back
    with pytest.raises(ValueError, match="probe_trials"):
        SpecPolicy(probe_trials=0)


def test_new_requests_are_probed_where_the_policy_pauses():
    """Acceptance is the requests' own: a request that drafted badly must not keep the batch
    paused for the requests after it. Once half the batch is new since the last drafting step,
    a paused bucket probes drafting at once, its old acceptance weighing as one sample; fewer
    new requests, or a bucket that drafts anyway, change nothing."""
    def run(p: SpecPolicy, batch: int, steps: int, accepted: int) -> list[str]:
        return _run_steps(p, batch, steps, accepted, spec_cost=1.5e-3, engine_timing=False)

    p = SpecPolicy(warmup=2, probe_every=1000, probe_first=1000, probe_len=2, k=3)
    run(p, 4, 20, accepted=0)  # a bad draft: paused (1 token per 1.5 ms drafting)
    assert p.summary()[4]["prefers"] == PLAIN
    p.admitted(1)  # a quarter of the batch is new: no probe
    assert set(run(p, 4, 10, accepted=3)) == {PLAIN}
    p.admitted(1)  # half of it now: drafting is probed, the new acceptance decides
    after = run(p, 4, 12, accepted=3)
    assert after[:3] == [SPEC] * 3 and set(after[3:]) == {SPEC}, after
    s = p.summary()[4]
    assert s["fresh_probes"] == 1 and s["prefers"] == SPEC
    # without the new requests, the stale estimate kept the batch paused (probes are rare)
    q = SpecPolicy(warmup=2, probe_every=1000, probe_first=1000, probe_len=2, k=3)
    run(q, 4, 20, accepted=0)
    assert set(run(q, 4, 12, accepted=3)) == {PLAIN}
    # a drafting bucket is not disturbed by new requests
    d = SpecPolicy(warmup=2, probe_every=1000, probe_first=1000, probe_len=2, k=3)
    run(d, 1, 20, accepted=3)
    d.admitted(1)
    assert set(run(d, 1, 6, accepted=3)) == {SPEC} and d.summary()[1]["fresh_probes"] == 0


def test_admission_probes_back_off_while_they_keep_losing():
    """A head that no request's text suits (a random one) would be probed at every admission of
    a paused batch-1 bucket: the probes of new requests back off, each losing one doubling the
    admissions passed over before the next (the 1st, 2nd, 4th, 8th ...); one that turns the
    bucket to drafting resets that. ``fresh_backoff=False`` probes every admission."""
    def admissions(p: SpecPolicy, n: int, accepted: int) -> list[int]:
        """Admit n requests one after another, 12 steps each; which of them were probed."""
        probed = []
        for i in range(n):
            before = p.summary()[1]["fresh_probes"]
            p.admitted(1)
            _run_steps(p, 1, 12, accepted, spec_cost=1.5e-3, engine_timing=False)
            if p.summary()[1]["fresh_probes"] > before:
                probed.append(i + 1)
        return probed

    def paused_policy(**kw) -> SpecPolicy:
        p = SpecPolicy(warmup=2, probe_every=1000, probe_first=1000, probe_len=2, k=3, **kw)
        _run_steps(p, 1, 20, 0, spec_cost=1.5e-3, engine_timing=False)
        assert p.summary()[1]["prefers"] == PLAIN
        return p

    p = paused_policy()
    assert admissions(p, 16, accepted=0) == [1, 2, 4, 8, 16]
    assert p.summary()[1]["fresh_skipped"] == 11
    assert admissions(p, 1, accepted=3) == []  # the 17th is passed over, though drafting pays
    assert admissions(p, 16, accepted=3)[:1] == [15]  # the 32nd is probed and finds it back
    assert p.summary()[1]["prefers"] == SPEC
    _run_steps(p, 1, 30, 0, spec_cost=1.5e-3, engine_timing=False)  # paused again: from 1
    assert p.summary()[1]["prefers"] == PLAIN
    assert admissions(p, 2, accepted=0) == [1, 2]
    flat = paused_policy(fresh_backoff=False)
    assert admissions(flat, 6, accepted=0) == [1, 2, 3, 4, 5, 6]
    assert flat.summary()[1]["fresh_skipped"] == 0
    with pytest.raises(ValueError, match="fresh_backoff"):
        SpecPolicy(fresh_backoff=1)


def test_policy_buckets_are_separate_and_arguments_checked():
    p = SpecPolicy(warmup=2, probe_every=1000, probe_first=1000)
    _drive(p, 1, 10, {SPEC: 1.2e-3, PLAIN: 1.0e-3}, tau=2.0)
    _drive(p, 100, 10, {SPEC: 4.0e-3, PLAIN: 1.0e-3}, tau=2.0)
    assert [bucket_of(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]
    assert p.summary()[1]["prefers"] == SPEC and p.summary()[128]["prefers"] == PLAIN
    for bad in (dict(warmup=0), dict(probe_every=True), dict(probe_len=-1), dict(alpha=0.0),
                dict(seed_warmup=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SpecPolicy(**bad)


def test_a_new_bucket_starts_from_its_measured_neighbour():
    """A batch run shrinks through buckets as requests finish: after the first bucket's full
    warm-up, each new one measures only seed_warmup steps of each mode (plus one switching
    step), starting from the nearest measured bucket's estimates."""
    p = SpecPolicy(warmup=8, seed_warmup=2, probe_every=1000, probe_first=1000)
    cost = {SPEC: 2.0e-3, PLAIN: 1.5e-3}
    first = _drive(p, 64, 40, cost, tau=2.7)
    assert first.count(PLAIN) == 8 and p.summary()[64]["seeded_from"] is None
    for batch in (32, 16, 8):  # each bucket measured once, then its neighbour seeds the next
        modes = _drive(p, batch, 20, cost, tau=2.7)
        assert modes[:4] == [SPEC, SPEC, PLAIN, PLAIN] and set(modes[4:]) == {SPEC}, modes
        assert p.summary()[batch]["seeded_from"] == 2 * batch
    # the nearest measured bucket by size class: 4 is seeded from 8, not from 64
    _drive(p, 4, 1, cost, tau=2.7)
    assert p.summary()[4]["seeded_from"] == 8


def test_a_seeded_bucket_follows_its_own_costs_where_they_disagree():
    p = SpecPolicy(warmup=4, seed_warmup=2, probe_every=1000, probe_first=1000)
    _drive(p, 1, 20, {SPEC: 1.2e-3, PLAIN: 1.0e-3}, tau=3.0)  # batch 1: drafting wins
    assert p.summary()[1]["prefers"] == SPEC
    modes = _drive(p, 128, 30, {SPEC: 9.0e-3, PLAIN: 1.0e-3}, tau=2.0)  # 0.22 vs 1.0 per ms
    assert p.summary()[128]["seeded_from"] == 1 and set(modes[6:]) == {PLAIN}
    s = p.summary()[128]
    # the seed weighs as one sample: a cost is the median of its first 1 / alpha samples
    assert s["plain_step_ms"] == pytest.approx(1.0)
    assert s["spec_step_ms"] == pytest.approx(9.0)


def test_slow_first_steps_do_not_decide_the_mode():
    """A mode's first steps can run several times slower than its steady state (first graph
    replays): the first samples' median, not their mean, makes the estimate, so three slow
    steps of 8 leave drafting the choice where it is 1.5x faster (their mean would be 2.85 ms
    against plain's 1.0 ms per 2.5 tokens: plain would win)."""
    p = SpecPolicy(warmup=8, probe_every=1000, probe_first=1000)
    modes = []
    for i in range(40):
        m = p.mode(1)
        slow = m == SPEC and i < 3
        p.observe(1, m, 6.0e-3 if slow else (1.5e-3 if m == SPEC else 1.0e-3),
                  2.5 if m == SPEC else 1.0)
        modes.append(m)
    assert set(modes[16:]) == {SPEC}, modes
    assert p.summary()[1]["spec_step_ms"] == pytest.approx(1.5)
    # after 1 / alpha samples the estimate is an EMA again: a lasting change turns the choice
    modes = _drive(p, 1, 60, {SPEC: 4.0e-3, PLAIN: 1.0e-3}, tau=2.5)
    assert set(modes[-20:]) == {PLAIN} and p.summary()[1]["prefers"] == PLAIN


def _drive_modes(policy: SpecPolicy, batch: int, steps: int, cost: dict[str, float],
                 tau: dict[str, float]) -> list[str]:
    modes = []
    for _ in range(steps):
        m = policy.mode(batch)
        policy.observe(batch, m, cost[m], tau.get(m, 1.0))
        modes.append(m)
    return modes


def test_policy_shrinks_k_where_fewer_drafts_verify_faster():
    """k shrinks: shrunk(w) verifies w of the k drafts. It is explored after drafting k and
    before plain steps, and wins where its tokens per second beat both (a compute-bound verify
    at large batch: fewer rows cost less, the drafts past w are the least often accepted)."""
    w = shrunk(2)
    assert (mode_k(SPEC, 5), mode_k(w, 5), mode_k(PLAIN, 5)) == (5, 2, 0)
    p = SpecPolicy(warmup=3, probe_every=1000, probe_first=1000, modes=(SPEC, w, PLAIN))
    cost = {SPEC: 3.0e-3, w: 1.6e-3, PLAIN: 1.0e-3}
    tau = {SPEC: 2.8, w: 2.0}  # 0.93, 1.25 and 1.0 tokens per ms
    modes = _drive_modes(p, 64, 40, cost, tau)
    assert modes[:9] == [SPEC] * 3 + [w] * 3 + [PLAIN] * 3 and set(modes[9:]) == {w}
    s = p.summary()[64]
    assert s["prefers"] == w and s["drafted_steps"] == 37 and s["paused_steps"] == 3
    assert s["shrunk"][w] == {"steps": 34, "step_ms": pytest.approx(1.6),
                              "tau": pytest.approx(2.0)}
    assert s["tau"] == pytest.approx(2.8)  # drafting k's own
    # where drafting k pays best it keeps k (the same costs, k's drafts accepted more often)
    p = SpecPolicy(warmup=3, probe_every=1000, probe_first=1000, modes=(SPEC, w, PLAIN))
    assert set(_drive_modes(p, 64, 40, cost, {SPEC: 4.5, w: 2.0})[9:]) == {SPEC}
    # probes visit every other mode in turn, so each estimate follows the prompts
    p = SpecPolicy(warmup=2, probe_every=8, probe_len=1, modes=(SPEC, w, PLAIN))
    modes = _drive_modes(p, 64, 40, cost, tau)
    probes = [m for i, m in enumerate(modes[6:], 7) if i % 8 in (0, 1) and m != w]
    assert {SPEC, PLAIN} <= set(probes), modes
    for bad in [(SPEC,), (SPEC, PLAIN, SPEC), (SPEC, "spec3", PLAIN)]:
        with pytest.raises(ValueError, match="modes="):
            SpecPolicy(modes=bad)


def test_tau_of_fewer_drafts_comes_from_the_acceptance_per_position():
    """Given k, a drafting mode's tau is 1 + sum over its draft positions j of P(accept >= j),
    from every step that verified that far: a shrunk mode is judged on the same prompts as
    drafting k (its own steps never see the positions past its drafts)."""
    w = shrunk(2)
    p = SpecPolicy(modes=(SPEC, w, PLAIN), k=4)
    p.observe_acceptance(8, [4, 4, 4, 4], [0, 1, 2, 4])  # >= 1: 3 / 4, >= 2: 2 / 4, ...
    b = p.buckets[8]
    assert p.tau(b, SPEC) == pytest.approx(1 + 0.75 + 0.5 + 0.25 + 0.25)
    assert p.tau(b, w) == pytest.approx(1 + 0.75 + 0.5) and p.tau(b, PLAIN) == 1.0
    # a shrunk step informs positions 1..2 only; a request verifying fewer drafts (near its
    # max_model_len) counts for the positions it verified
    p.observe_acceptance(8, [2, 2], [2, 0])
    p.observe_acceptance(8, [4, 1], [3, 1])
    assert p.tau(b, w) == pytest.approx(1 + (0.75 + 0.5 + 1.0) / 3 + (0.5 + 0.5 + 1.0) / 3)
    assert p.tau(b, SPEC) == pytest.approx(p.tau(b, w) + (0.25 + 1.0) / 2 + (0.25 + 0.0) / 2)
    # without k (or positions never verified) a mode's own steps' tau stands
    q = SpecPolicy(modes=(SPEC, w, PLAIN))
    q.observe(8, w, 1e-3, 1.7)
    q.observe_acceptance(8, [4], [4])
    assert q.tau(q.buckets[8], w) == pytest.approx(1.7)
    with pytest.raises(ValueError, match="k="):
        SpecPolicy(k=-1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("policy")
    target = write_bigram_target(root / "target", layers=2)
    return target, write_mirror_eagle1(root / "noisy", target, noise=0.3)


PROMPTS = [[3, 17, 5, 9, 22, 1, 8], [7], list(range(1, 30)), [11, 12]]
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_adaptive_engine_is_lossless_and_reports_its_choices(pair, smollm2_gguf_path):
    target, head = pair
    vanilla = [o.token_ids for o in LLM(model=target, tokenizer=smollm2_gguf_path,
                                        max_model_len=128).generate(PROMPTS, GREEDY)]
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, draft=head,
              num_speculative_tokens=3, speculation_policy="adaptive")
    pol = llm.engine.stats.policy = SpecPolicy(warmup=3, probe_every=8, probe_len=2)
    admitted, real = [], pol.admitted
    pol.admitted = lambda n: admitted.append(n) or real(n)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == vanilla
    assert sum(admitted) == len(PROMPTS)  # each request reported once, at its prompt
    s = llm.stats.policy.summary()[4]
    assert s["drafted_steps"] > 0 and s["paused_steps"] > 0
    assert s["spec_step_ms"] > 0 and s["plain_step_ms"] > 0 and s["tau"] >= 1.0
    assert s["prefers"] in (SPEC, PLAIN)
    with pytest.raises(ValueError, match="speculation_policy='sometimes'"):
        LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, draft=head,
            speculation_policy="sometimes")
    with pytest.raises(ValueError, match="not supported with draft trees"):
        LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, draft=head,
            speculative_topk=2, speculation_policy="adaptive")


def _draft_kv_after(pair, tok, prompt, policy=None, no_sync=False, ahead=None, defer=True):
    """The draft's K cache over the request's positions once it has finished (fp32, CPU).
    ``ahead``: with emulated graphs, verify ahead on or off; ``defer``: paused steps defer
    their first pass (engine/deferred_first_pass.py)."""
    from tests.engine_runs import with_emulated_graphs

    target, head = pair
    kw = {} if ahead is None else {"verify_ahead": ahead, "max_num_seqs": 4}
    kw["defer_paused_first_pass"] = defer
    llm = LLM(model=target, tokenizer=tok, max_model_len=128, draft=head, num_speculative_tokens=3,
              speculation_policy="always" if policy is None else "adaptive", **kw)
    if ahead is not None:
        with_emulated_graphs(llm, k=3)
    eng = llm.engine
    if policy is not None:
        eng.stats.policy = policy
    if no_sync:  # no paused first pass: neither run by the step nor deferred and flushed
        eng.runner.proposer.sync = lambda *a, **k: None
        deferred = eng.runner.deferred
        if deferred is not None:
            deferred._flush = lambda why, newest=None: deferred.drop()
    tables = {}
    free = eng.allocator.free

    def keep_table(req_id):
        tables[req_id] = list(eng.allocator.tables.get(req_id, ()))
        return free(req_id)

    eng.allocator.free = keep_table
    out = llm.generate([prompt], GREEDY)[0]
    n = len(prompt) + len(out.token_ids) - 8  # positions every first pass has covered by now
    (table,) = tables.values()
    page = eng.allocator.page_size
    k_cache = eng.kv_caches[eng.model.config.num_hidden_layers][0]  # the draft layer's K
    rows = [k_cache[table[p // page], p % page] for p in range(n)]
    return out.token_ids, torch.stack(rows), llm.stats.verify_ahead


def test_paused_steps_keep_the_draft_kv_complete(pair, smollm2_gguf_path):
    """While paused, the draft's first pass still writes its KV at the accepted positions: the
    draft cache after a run alternating modes equals an always-drafting run's (and the check
    fails when the paused steps skip that pass)."""
    prompt = PROMPTS[0]
    ids, ref, _ = _draft_kv_after(pair, smollm2_gguf_path, prompt)
    alternate = [SPEC] * 3 + [PLAIN] * 3  # 3 drafting steps, then 3 paused ones, and so on
    ids2, got, _ = _draft_kv_after(pair, smollm2_gguf_path, prompt,
                                   policy=ModesInTurn(alternate))
    assert ids2 == ids
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    _, holes, _ = _draft_kv_after(pair, smollm2_gguf_path, prompt,
                                  policy=ModesInTurn(alternate), no_sync=True)
    assert not torch.allclose(holes, ref, rtol=1e-5, atol=1e-5)


def test_shrunk_k_is_lossless_and_verifies_fewer_drafts(pair, smollm2_gguf_path):
    """adaptive_k: steps that verify 1 or 2 of the 3 drafts, alone or mixed with full and
    paused steps in every order, write vanilla's output, greedy and seeded sampling; a step
    shrunk to 1 verifies one draft per request."""
    target, head = pair
    sampled = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    vanilla = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128)
    want = {id(sp): [o.token_ids for o in vanilla.generate(PROMPTS, sp)]
            for sp in (GREEDY, sampled)}
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, draft=head,
              num_speculative_tokens=3, speculation_policy="adaptive", adaptive_k=(1, 2))
    assert llm.stats.policy.modes == (SPEC, shrunk(2), shrunk(1), PLAIN)
    llm.engine.stats.policy = ModesInTurn([shrunk(1)])
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want[id(GREEDY)]
    st = llm.stats.spec
    assert st.num_drafting_steps > 0 and st.num_draft_tokens == st.num_drafting_steps
    for sp in (GREEDY, sampled):
        llm.engine.reset_stats()
        llm.engine.stats.policy = ModesInTurn([SPEC, shrunk(2), shrunk(1), shrunk(1), PLAIN,
                                               SPEC, PLAIN, shrunk(2)])
        assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == want[id(sp)]
        st = llm.stats.spec
        assert 1 < st.num_draft_tokens / st.num_drafting_steps < 3, st.as_dict()
    for bad, match in [(dict(adaptive_k=(3,)), "adaptive_k=\\(3,\\): 3 is not an integer in 1..2"),
                       (dict(adaptive_k=2), "adaptive_k=2: expected a tuple"),
                       (dict(adaptive_k=(1,), speculation_policy="always"),
                        "needs speculation_policy='adaptive'")]:
        kw = dict(speculation_policy="adaptive") | bad
        with pytest.raises(ValueError, match=match):
            LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, draft=head,
                num_speculative_tokens=3, **kw)


@pytest.mark.heavy
@pytest.mark.parametrize("defer", [False, True])
def test_paused_steps_launch_the_next_decode_ahead(pair, smollm2_gguf_path, monkeypatch, defer):
    """With graphs (emulated here) and verify ahead, a paused step replays the draft's first
    pass from the device argmax (or defers it) and launches the next decode before the host
    reads its token (engine/paused_ahead.py): the output is vanilla's, the launches are taken,
    and the draft's KV is what the late path writes (same acceptance per position; without the
    first pass's replay or flush the KV differs)."""
    from compiled_spec.engine.deferred_first_pass import DeferredFirstPass
    from compiled_spec.engine.sync_graph import SyncGraphs
    from tests.engine_runs import with_emulated_graphs

    target, head = pair
    vanilla = [o.token_ids for o in LLM(model=target, tokenizer=smollm2_gguf_path,
                                        max_model_len=128).generate(PROMPTS, GREEDY)]

    def run(ahead: bool) -> tuple[list[list[int]], list[int], dict]:
        llm = with_emulated_graphs(LLM(
            model=target, tokenizer=smollm2_gguf_path, max_model_len=128, draft=head,
            num_speculative_tokens=3, speculation_policy="adaptive", verify_ahead=ahead,
            max_num_seqs=4, defer_paused_first_pass=defer), k=3)
        llm.engine.stats.policy = ModesInTurn([PLAIN] * 4 + [SPEC] * 2)
        ids = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        return ids, list(llm.stats.spec.accepted_per_position), llm.stats.verify_ahead.as_dict()

    late_ids, late_acc, _ = run(False)
    ids, acc, va = run(True)
    assert ids == late_ids == vanilla
    assert acc == late_acc, (acc, late_acc)
    assert va["launched"] >= 10 and va["taken"] >= 10, va
    # the draft's KV: as the late path writes it, and not without the first pass's replay
    modes = ModesInTurn([SPEC] * 2 + [PLAIN] * 4)
    _, late, _ = _draft_kv_after(pair, smollm2_gguf_path, PROMPTS[0], modes, ahead=False,
                                 defer=defer)
    _, got, va = _draft_kv_after(pair, smollm2_gguf_path, PROMPTS[0], ModesInTurn(modes.modes),
                                 ahead=True, defer=defer)
    assert va.taken >= 10, va  # paused steps at batch 1 (the verify graph, one live row)
    torch.testing.assert_close(got, late, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(SyncGraphs, "run", lambda self, *a, **k: True)  # no first pass
    monkeypatch.setattr(DeferredFirstPass, "_flush", lambda self, *a, **k: self.drop())
    _, holes, _ = _draft_kv_after(pair, smollm2_gguf_path, PROMPTS[0],
                                  ModesInTurn(modes.modes), ahead=True, defer=defer)
    assert not torch.allclose(holes, late, rtol=1e-5, atol=1e-5)


def test_default_policy_is_adaptive_for_cuda_chains_only(monkeypatch, pair, smollm2_gguf_path):
    from compiled_spec.config import speculation_policy_default

    monkeypatch.delenv("COMPILED_SPEC_SPECULATION_POLICY", raising=False)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert speculation_policy_default(cuda, tree=False) == "adaptive"
    assert speculation_policy_default(cuda, tree=True) == "always"  # trees have no policy
    assert speculation_policy_default(cpu, tree=False) == "always"
    assert speculation_policy_default(cuda, tree=False, tensor_parallel=2) == "always"
    monkeypatch.setenv("COMPILED_SPEC_SPECULATION_POLICY", "adaptive")
    assert speculation_policy_default(cpu, tree=False) == "adaptive"
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        speculation_policy_default(cuda, tree=False, tensor_parallel=2)
    monkeypatch.setenv("COMPILED_SPEC_SPECULATION_POLICY", "sometimes")
    with pytest.raises(ValueError, match="COMPILED_SPEC_SPECULATION_POLICY='sometimes'"):
        speculation_policy_default(cuda, tree=False)
    monkeypatch.delenv("COMPILED_SPEC_SPECULATION_POLICY")
    target, head = pair

    def policy(**kw) -> str:
        llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=64, draft=head,
                  num_speculative_tokens=3, **kw)
        return llm.config.spec.speculation_policy

    assert policy() == "always"  # the CPU
    assert policy(adaptive_k=(1,)) == "adaptive"  # smaller k only exists under the policy
    monkeypatch.setenv("COMPILED_SPEC_SPECULATION_POLICY", "adaptive")
    assert policy() == "adaptive"
    assert policy(speculation_policy="always") == "always"  # an explicit choice wins
    # ranks timing their own steps could disagree on a mode: refused before any rank starts
    with pytest.raises(ValueError, match="'adaptive'.*tensor_parallel_size=2"):
        policy(speculation_policy="adaptive", tensor_parallel_size=2)


def test_parity_drafts_every_step_under_an_adaptive_policy(pair, smollm2_gguf_path):
    """An adaptive engine's pauses follow measured step costs, which compiling changes: the
    parity check runs both modes drafting every step, then hands the policy back."""
    target, head = pair
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, max_model_len=128, draft=head,
              num_speculative_tokens=3, speculation_policy="adaptive")
    eng = llm.engine
    stub = ModesInTurn([PLAIN])  # a policy that would never draft
    eng.stats.policy = stub
    rep = llm.check_parity(PROMPTS[:2], SamplingParams(max_tokens=24, temperature=0.0))
    assert rep.ok, str(rep)
    assert rep.eager.tau is not None and rep.compiled.tau is not None
    assert rep.eager.tau > 1.0  # this head is accepted: steps drafted at full k
    assert eng.stats.policy is stub and stub.n == 0  # not consulted, and back in place
    llm.generate([PROMPTS[0]], GREEDY)
    assert stub.n > 0
