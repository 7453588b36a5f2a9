"""The CI parity gate: eager and compiled (torch.compile through our backend, Inductor's C++ code
on the CPU) give the same greedy tokens and the same acceptance, with an EAGLE-3 head that agrees
often; and the check fails on the public bug class (a compiled draft fed wrong inputs, or whose
compiled step returns stale outputs as an uncaptured/unreplayed graph would)."""
import random

import pytest
import torch

from compiled_spec import LLM, SamplingParams

SP = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(trained_eagle3_pair, smollm2_gguf_path):
    target, head = trained_eagle3_pair
    return LLM(model=target, tokenizer=smollm2_gguf_path, draft=head, method="eagle3",
               num_speculative_tokens=3, max_model_len=128, compile=True)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(31) for _ in range(rng.randint(1, 8))] for _ in range(4)]


def test_eager_and_compiled_agree(llm, prompts):
    rep = llm.check_parity(prompts, SP, tau_tolerance=0.0)
    print(rep)
    assert rep.ok, str(rep)
    assert rep.eager.tau >= 2.0  # the gate only means something with a head that agrees
    assert rep.eager.token_ids == rep.compiled.token_ids
    stats = llm.compile_stats
    # The EAGLE-3 fc was hoisted out of every compiled first-pass graph, and every draft
    # attention op was bound to its own layer's metadata.
    fp = stats["draft_first_pass"]
    assert fp["graphs"] >= 1 and fp["pass_matches"]["HoistEagle3Fc"] == fp["graphs"]
    # Steps 2..k run as one compiled callable with their pick (step + logits + argmax).
    assert stats["draft_step_pick"]["graphs"] >= 1
    assert stats["draft_step_pick"]["pass_matches"]["BindPerLayerAttnMetadata"] >= 1
    assert llm.compiled_active  # check_parity restores the mode it found


def _swap(llm, name, fn):
    models = llm._compiled
    real = models.compiled[name]
    models.compiled[name] = fn(real)
    return lambda: models.compiled.__setitem__(name, real)


def test_parity_fails_when_compiled_fc_gets_wrong_inputs(llm, prompts):
    # The aux states in the wrong order: what a compiled fc fed the wrong tensors would compute.
    restore = _swap(llm, "first_pass", lambda real: lambda aux, *a: real(aux[::-1], *a))
    try:
        rep = llm.check_parity(prompts, SP)
    finally:
        restore()
    assert not rep.ok and "tau" in " ".join(rep.failures)
    assert rep.compiled.tau < rep.eager.tau - 0.5
    # Lossless all the same: the outputs are the target's.
    assert rep.eager.token_ids == rep.compiled.token_ids


def test_parity_fails_when_compiled_draft_step_is_stale(llm, prompts):
    # A draft step whose graph was never replayed with fresh inputs returns old outputs.
    # (The chain's steps 2..k run the compiled step + pick callable.)
    def stale(real):
        cache = {}

        def fn(ids, hidden, positions, meta, temperature, seeds):
            out = real(ids, hidden, positions, meta, temperature, seeds)
            key = ids.shape[0]
            cache.setdefault(key, tuple(None if t is None else t.clone() for t in out))
            return cache[key]
        return fn

    restore = _swap(llm, "step_pick", stale)
    try:
        rep = llm.check_parity(prompts, SP)
    finally:
        restore()
    assert not rep.ok
    assert rep.compiled.tau < rep.eager.tau


def _report(eager_tau, comp_tau, divergence, require_identical=False):
    from compiled_spec.parity import ParityReport, ParityRun, judge
    rep = ParityReport(eager=ParityRun("eager", eager_tau, None, []),
                       compiled=ParityRun("compiled", comp_tau, None, []), tau_tolerance=0.05,
                       require_identical=require_identical, first_divergence=divergence)
    judge(rep, speculative=True)
    return rep


def test_judge_over_parted_text_fails_only_a_drop():
    # bf16: eager and compiled outputs parted (the H100's tree in the thirty-eighth session:
    # 2.784 eager, 2.933 compiled), so their taus are over different text.
    up = _report(2.784, 2.933, [29, 113, None])
    assert up.ok and up.notes and "above eager" in up.notes[0]
    assert "note:" in str(up) and "PASS" in str(up)
    down = _report(2.933, 2.784, [29, 113, None])
    assert not down.ok and "differs by more than 0.05" in down.failures[0]
    assert _report(2.10, 2.067, [6, None]).ok  # within the tolerance


def test_judge_over_the_same_text_fails_either_way():
    # The same tokens: only the draft's numerics can move tau, so a rise is suspect too.
    assert not _report(2.10, 2.30, [None, None]).ok
    assert not _report(2.30, 2.10, [None, None]).ok
    assert _report(2.10, 2.10, [None, None]).ok
    # fp32 greedy: parted outputs fail on their own, whatever tau did.
    rep = _report(2.10, 2.10, [4, None], require_identical=True)
    assert not rep.ok and "greedy fp32 outputs differ on 1 of 2" in rep.failures[0]
    assert not _report(None, 2.1, [None]).ok
