"""Verify ahead (compiled_spec/engine/verify_ahead.py) on the CPU through emulated graphs: an
early chain step launches the next step's verify before the engine's bookkeeping. Greedy output
must equal vanilla decoding and the same engine without it, acceptance must not change, the
launched verifies must actually be taken (no pass by always discarding), and every discard or
skip is counted by reason: requests finishing mid-batch (the rest taken as a subset), requests
admitted next step, requests at their budget, a reset after an abort; requests that wait while
nothing is admitted do not stop a launch."""
from __future__ import annotations

import pytest

from compiled_spec import LLM, SamplingParams
from compiled_spec.engine.stats import counts_since
from tests.engine_runs import generate_in_batches as _gen
from tests.engine_runs import assert_same_logprobs, with_emulated_graphs

K = 3
PROMPTS = [[3, 7, 1], [5], [9, 2, 4, 4, 8, 1, 2], [11, 12], [6, 6, 6, 1, 2], [4, 4]]


KW: dict = dict(max_model_len=128, max_num_seqs=4, page_size=4, num_kv_blocks=128)


@pytest.fixture(scope="module")
def engines(trained_eagle3_pair, smollm2_gguf_path):
    """(speculative LLM with emulated graphs and verify ahead on; vanilla eager LLM)."""
    target, head = trained_eagle3_pair
    kw = dict(model=target, tokenizer=smollm2_gguf_path, **KW)
    spec = with_emulated_graphs(LLM(draft=head, num_speculative_tokens=K, verify_ahead=True, **kw), K)
    return spec, LLM(**kw)


@pytest.fixture(scope="module")
def vanilla_ahead(trained_eagle3_pair, smollm2_gguf_path):
    """A vanilla LLM with emulated graphs whose decode steps launch the next one ahead."""
    return with_emulated_graphs(LLM(model=trained_eagle3_pair[0], tokenizer=smollm2_gguf_path,
                        verify_ahead=True, **KW), 0)


def _run(spec: LLM, on: bool, prompts, sps, batch: int) -> tuple[list[list[int]], int, dict]:
    """(outputs, accepted drafts, verify-ahead counters of this run) with the switch set."""
    ahead, st = spec.engine.runner.ahead, spec.stats
    ahead.enabled = on
    acc0, before = st.spec.num_accepted_tokens, st.verify_ahead.as_dict()
    try:
        out = _gen(spec, prompts, sps, batch)
    finally:
        ahead.enabled = True
    return (out, st.spec.num_accepted_tokens - acc0,
            counts_since(before, st.verify_ahead.as_dict()))


def _sps(max_tokens: list[int], **kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, **kw)
            for m in max_tokens]


def _stop_mid_batch(vanilla: LLM, prompts, budgets: list[int]
                    ) -> tuple[list[SamplingParams], list[list[int]]]:
    """Greedy requests with ``budgets``, request 1 stopped by the 9th token vanilla gives it
    (a stop the engine cannot foresee): (sampling params, vanilla's outputs)."""
    free = _sps(budgets)
    stop_tok = _gen(vanilla, prompts[1:2], free[1:2], 1)[0][8]
    sps = free[:1] + _sps(budgets[1:2], stop_token_ids=[stop_tok]) + free[2:]
    ref = _gen(vanilla, prompts, sps, 1)
    assert len(ref[1]) <= 9 and ref[1][-1] == stop_tok
    return sps, ref


@pytest.mark.parametrize("batch", [1, 3])
def test_verify_ahead_equals_vanilla_and_off(engines, batch):
    """Requests of different lengths in one batch, each verifying its full k up to its budget
    (kv_limit): the step that ends a request launches for the others, or, alone, nothing."""
    spec, vanilla = engines
    sps = _sps([9, 30, 14, 22, 17, 26])
    ref = _gen(vanilla, PROMPTS, sps, 1)
    off, off_acc, off_st = _run(spec, False, PROMPTS, sps, batch)
    on, on_acc, on_st = _run(spec, True, PROMPTS, sps, batch)
    assert off == ref and on == ref
    assert off_st["launched"] == 0 and off_st["skipped"].get("off", 0) > 0, off_st
    assert on_st["launched"] > 0 and on_st["taken"] > 0, on_st  # no pass by falling back
    assert on_acc == off_acc > 0  # acceptance unchanged
    assert spec.stats.num_step_faults == 0  # no step raised (a retried step hides in output)
    # Near its budget a request still verifies k drafts: no step is "short" (that is for
    # max_model_len); alone, each request's last step ends all there is, so it launches nothing.
    assert "short" not in on_st["skipped"], on_st
    if batch == 1:
        assert on_st["skipped"].get("stopping", 0) == len(PROMPTS), on_st
    else:
        assert on_st["taken_subset"] > 0, on_st
    used = on_st["taken"] + on_st["taken_subset"] + sum(on_st["discarded"].values())
    assert used == on_st["launched"], on_st  # every launch is taken or discarded, once


@pytest.mark.parametrize("batch", [1, 3])
def test_sampled_chain_ahead_equals_vanilla(engines, batch):
    """Sampled requests (early steps from vanilla's draws) launch the next verify as greedy
    ones do: vanilla sampling's tokens, with and without it, the same acceptance, launches
    taken."""
    spec, vanilla = engines
    kinds = [dict(temperature=0.8), dict(temperature=1.0, top_k=20), dict(temperature=0.0)]
    sps = [SamplingParams(max_tokens=m, ignore_eos=True, seed=7 + i, **kinds[i % 3])
           for i, m in enumerate([12, 20, 15, 9, 18, 14])]
    ref = _gen(vanilla, PROMPTS, sps, batch)
    off, off_acc, _ = _run(spec, False, PROMPTS, sps, batch)
    on, on_acc, on_st = _run(spec, True, PROMPTS, sps, batch)
    assert off == ref and on == ref
    assert on_st["launched"] > 0 and on_st["taken"] + on_st["taken_subset"] > 0, on_st
    assert on_acc == off_acc > 0
    assert spec.stats.num_step_faults == 0
    # with logprobs too, budgets apart so that launches are taken for the rest (their rows)
    lp = [SamplingParams(max_tokens=m, ignore_eos=True, seed=9, logprobs=x, **kinds[i])
          for i, (m, x) in enumerate([(7, 2), (19, None), (13, 1)])]
    before = spec.stats.verify_ahead.as_dict()
    got = spec.generate(PROMPTS[:3], lp, use_tqdm=False)
    st = counts_since(before, spec.stats.verify_ahead.as_dict())
    assert_same_logprobs(got, vanilla.generate(PROMPTS[:3], lp, use_tqdm=False))
    assert st["taken_subset"] > 0, st
    assert spec.stats.num_step_faults == 0


def test_request_stopping_mid_batch_leaves_a_subset(engines):
    """A stop token ends one request of three well before its budget: the verify launched
    for all three is taken for the two that go on (their rows gathered, the fc redone), with
    the acceptance of the same engine without it (wrong hidden rows would change the drafts
    but not the output); run alone, the request launches nothing after its stop token."""
    spec, vanilla = engines
    prompts = PROMPTS[:3]
    sps, ref = _stop_mid_batch(vanilla, prompts, [30, 30, 30])
    _, off_acc, _ = _run(spec, False, prompts, sps, 3)
    out, on_acc, st = _run(spec, True, prompts, sps, 3)
    assert out == ref
    assert st["taken_subset"] > 0 and st["taken"] > 0, st
    assert on_acc == off_acc > 0
    # Alone, each request's last step (the stop token, or its budget) launches nothing.
    out, _, st = _run(spec, True, prompts, sps, 1)
    assert out == ref
    assert st["skipped"].get("stopping", 0) == len(prompts) and not st["discarded"], st


def test_stop_token_mid_batch_and_waiting_requests(engines):
    """A stop token ends a request the launch assumed would go on; more requests than the engine
    runs at once wait for admission (no launch where one would be admitted next step). Output
    stays vanilla's."""
    spec, vanilla = engines
    sps, ref = _stop_mid_batch(vanilla, PROMPTS, [12, 20, 16, 18, 15, 21])
    out, _, st = _run(spec, True, PROMPTS, sps, 6)  # 6 requests, 4 run at a time
    assert out == ref
    assert st["skipped"].get("admitting", 0) > 0, st
    assert st["taken"] + st["taken_subset"] > 0, st


def test_launches_while_requests_wait_and_none_is_admitted(engines):
    """Six long requests, four slots: while none of the four ends, the two waiting ones are not
    admitted, so steps launch ahead with requests waiting (before, any waiting request stopped
    every launch), and those launches are taken; output stays vanilla's."""
    spec, vanilla = engines
    sps = _sps([26, 30, 28, 24, 12, 12])
    ref = _gen(vanilla, PROMPTS, sps, 1)
    eng = spec.engine
    before = eng.stats.verify_ahead.as_dict()
    ids = [eng.add_request(p, s) for p, s in zip(PROMPTS, sps)]
    done, waiting_launches = {}, 0
    while eng.has_unfinished():
        for req in eng.step():
            done[req.req_id] = req.output_token_ids
        waiting_launches += bool(eng.scheduler.waiting and eng.runner.ahead._launched)
    st = counts_since(before, eng.stats.verify_ahead.as_dict())
    assert [done[i] for i in ids] == ref
    assert waiting_launches > 0, st
    assert st["taken"] > 0 and st["skipped"].get("admitting", 0) > 0, st  # admitted: skipped


def test_abort_discards_the_launched_verify(engines):
    """An abort between steps resets the runner: a launched verify is dropped, counted, and the
    engine goes on exactly."""
    spec, vanilla = engines
    sps = _sps([24, 24])
    prompts = [PROMPTS[0], PROMPTS[2]]
    ref = _gen(vanilla, prompts, sps, 2)
    eng = spec.engine
    before = dict(eng.stats.verify_ahead.discarded)
    ids = [eng.add_request(p, s) for p, s in zip(prompts, sps)]
    extra = eng.add_request(PROMPTS[3], _sps([40])[0])
    for _ in range(4):
        eng.step()
    assert eng.runner.ahead._launched is not None  # a verify is in flight for the next step
    eng.abort({extra}, "test")
    done = {}
    while eng.has_unfinished():
        for req in eng.step():
            done[req.req_id] = req.output_token_ids
    assert [done[i] for i in ids] == ref
    assert eng.stats.verify_ahead.discarded.get("reset", 0) > before.get("reset", 0)


@pytest.mark.parametrize("batch", [1, 3])
def test_vanilla_decode_ahead_equals_vanilla(engines, vanilla_ahead, batch):
    """Greedy decoding whose next step is launched from the device argmax before the host reads
    it: the same tokens as plain decoding, with requests stopping mid-batch (a stop token,
    different budgets: the rest taken as a subset); sampled requests launch from the device's
    draw as greedy ones do from the argmax, and requests wanting logprobs launch too."""
    _, vanilla = engines
    sps, ref = _stop_mid_batch(vanilla, PROMPTS, [9, 30, 14, 22, 17, 26])
    out, _, st = _run(vanilla_ahead, True, PROMPTS, sps, batch)
    assert out == ref
    assert st["launched"] > 0 and st["taken"] > 0, st
    assert st["skipped"].get("short", 0) > 0, st  # a request's last token: no next step
    if batch > 1:
        assert st["taken_subset"] > 0, st
    off, _, off_st = _run(vanilla_ahead, False, PROMPTS, sps, batch)
    assert off == ref and off_st["launched"] == 0
    sampled = [SamplingParams(max_tokens=12, temperature=0.8, seed=3),
               SamplingParams(max_tokens=15, temperature=1.0, top_k=20, seed=4),
               SamplingParams(max_tokens=10, temperature=0.0)]
    out, _, st = _run(vanilla_ahead, True, PROMPTS[:3], sampled, batch)
    ref = _gen(vanilla, PROMPTS[:3], sampled, batch)
    assert out == ref and st["launched"] > 0 and st["taken"] > 0, st
    assert "sampling" not in st["skipped"], st
    # Logprobs: computed on the device before the launch overwrites the logits
    lp = [SamplingParams(max_tokens=9, temperature=0.0, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=12, temperature=0.9, seed=2, logprobs=1, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    before = vanilla_ahead.stats.verify_ahead.as_dict()
    got = vanilla_ahead.generate(PROMPTS[:3], lp, use_tqdm=False)
    st = counts_since(before, vanilla_ahead.stats.verify_ahead.as_dict())
    assert_same_logprobs(got, vanilla.generate(PROMPTS[:3], lp, use_tqdm=False))
    assert st["launched"] > 0 and st["taken"] > 0 and "logprobs" not in st["skipped"], st


def test_default_on_for_cuda_only(monkeypatch):
    """Unset: on for CUDA (it overlaps the host's turnaround), off on the CPU (ops run as issued:
    nothing to overlap); COMPILED_SPEC_VERIFY_AHEAD overrides both ways."""
    import torch

    from compiled_spec.config import verify_ahead_default
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("COMPILED_SPEC_VERIFY_AHEAD", raising=False)
    assert (verify_ahead_default(cpu), verify_ahead_default(cuda)) == (False, True)
    monkeypatch.setenv("COMPILED_SPEC_VERIFY_AHEAD", "1")
    assert (verify_ahead_default(cpu), verify_ahead_default(cuda)) == (True, True)
    monkeypatch.setenv("COMPILED_SPEC_VERIFY_AHEAD", "0")
    assert (verify_ahead_default(cpu), verify_ahead_default(cuda)) == (False, False)


def test_num_ending_reads_eos_stop_ids_and_budget(engines):
    """A launch is skipped ("stopping") only when every request ends this step: a token that
    stops it (the engine's EOS unless ignore_eos, one of its stop token ids) or its budget."""
    from types import SimpleNamespace

    ahead = engines[0].engine.runner.ahead
    assert ahead.eos_token_ids  # the engine gave the runner its EOS ids
    eos = min(ahead.eos_token_ids)
    q = [SimpleNamespace(params=SamplingParams(max_tokens=8), num_tokens=3,
                         max_total_tokens=11),
         SimpleNamespace(params=SamplingParams(max_tokens=8, ignore_eos=True,
                                               stop_token_ids=[7]), num_tokens=3,
                         max_total_tokens=11)]
    assert ahead.num_ending(q[:1], [[3, eos]]) == 1
    assert ahead.num_ending(q[1:], [[3, eos]]) == 0  # EOS ignored
    assert ahead.num_ending(q[1:], [[7, 3]]) == 1
    assert ahead.num_ending(q, [[3, eos], [3, 4]]) == 1  # one goes on: launch, take its rows
    assert ahead.num_ending(q, [[eos], [7]]) == 2
    assert ahead.num_ending(q[1:], [[1] * 8]) == 1  # 3 + 8 tokens: its budget of 11


def test_host_phases_partition_the_step(engines):
    """``stats.host_phase_s`` (engine/host_clock.py): an early chain step's host time by phase,
    the phases of this path all present, their sum with the prompt steps' (apart) the step time
    (the marks partition it), the wait the host's blocked time."""
    spec, _ = engines
    spec.engine.reset_stats()
    _run(spec, True, PROMPTS[:3], _sps([20, 20, 20]), 3)
    st = spec.stats
    ph = st.host_phase_s
    assert {"schedule", "verify", "plan", "accept", "wait", "launch_ahead", "execute",
            "bookkeeping", "propose", "other"} <= set(ph), ph
    assert all(v >= 0 for v in ph.values()), ph
    pre = st.prompt_host_phase_s  # the steps that carried the prompts
    assert st.num_prefill_steps > 0 and {"schedule", "verify", "accept", "propose"} <= set(pre)
    total, total_pre = sum(ph.values()), sum(pre.values())
    # The marks start after step()'s first clock read and end after its last: the sums hold
    # step_s (prefill_step_s) and a few statements more per step.
    slack = 2e-4 * st.num_steps + 0.01
    assert st.step_s * 0.98 <= total + total_pre <= st.step_s + slack, (total, st.step_s)
    assert st.prefill_step_s * 0.98 <= total_pre <= st.prefill_step_s + slack
    assert ph["wait"] + pre.get("wait", 0.0) >= st.host_wait_s * 0.98
