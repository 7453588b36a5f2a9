"""The vanilla engine on a tiny random Llama checkpoint: batching, paging, seeds, errors."""
import json

import pytest
import torch

from compiled_spec import LLM, SamplingParams


@pytest.fixture(scope="module")
def tiny_llm_dir(tmp_path_factory, smollm2_tokenizer):
    from tests.spec_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), smollm2_tokenizer)


def _llm(path, **kw):
    kw.setdefault("max_model_len", 128)
    return LLM(model=path, **kw)


PROMPTS = [[5, 17, 300, 42, 8, 9, 1000], [77] * 3, list(range(100, 140)), [9, 8]]


def _ids(outs):
    return [o.token_ids for o in outs]


def test_page_sizes_agree_and_blocks_return(tiny_llm_dir):
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    res = {}
    for page in (1, 16):
        llm = _llm(tiny_llm_dir, page_size=page, max_num_seqs=2)
        res[page] = _ids(llm.generate(PROMPTS, sp))
        alloc = llm.engine.allocator
        assert alloc.num_free == alloc.num_blocks and not alloc.tables
    assert res[1] == res[16]
    assert all(len(t) == 20 for t in res[1])


def test_batch_equals_alone_greedy_and_seeded(tiny_llm_dir):
    llm = _llm(tiny_llm_dir, page_size=4, max_num_seqs=8)
    for sp in (SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
               SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=123, ignore_eos=True)):
        together = _ids(llm.generate(PROMPTS, sp))
        alone = [_ids(llm.generate([p], sp))[0] for p in PROMPTS]
        assert together == alone
    # Continuous batching: more requests than sequences per step, all finish, pool is full again.
    outs = llm.generate(PROMPTS * 3, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert all(o.finish_reason == "length" and len(o.token_ids) == 5 for o in outs)
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_blocks


def test_seeded_sampling_reproducible_across_engines(tiny_llm_dir):
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    a = _ids(_llm(tiny_llm_dir, seed=1).generate(PROMPTS, sp))
    b = _ids(_llm(tiny_llm_dir, seed=2, page_size=1).generate(PROMPTS[::-1], sp))[::-1]
    assert a == b
    c = _ids(_llm(tiny_llm_dir).generate(PROMPTS, SamplingParams(max_tokens=12, seed=8, ignore_eos=True)))
    assert c != a  # a different seed gives different samples


def test_preemption_keeps_outputs_identical(tiny_llm_dir):
    sp = SamplingParams(max_tokens=30, temperature=0.7, seed=5, ignore_eos=True)
    ref = _ids(_llm(tiny_llm_dir, page_size=4).generate(PROMPTS, sp))
    small = _llm(tiny_llm_dir, page_size=4, num_kv_blocks=20, max_num_seqs=4)
    got = _ids(small.generate(PROMPTS, sp))
    assert got == ref
    assert small.stats.num_preemptions > 0
    assert small.engine.allocator.num_free == 20


def test_request_too_big_for_pool_is_aborted_alone(tiny_llm_dir):
    llm = _llm(tiny_llm_dir, page_size=4, num_kv_blocks=6, max_num_seqs=4)
    big, small = llm.generate([[3] * 10, [4] * 3], [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)])
    assert big.finish_reason == "abort" and "KV cache exhausted" in big.outputs[0].error
    # It ran until the 6 blocks of 4 held 24 positions; the last of them produced token 25.
    assert len(big.token_ids) == 25 - 10
    assert small.finish_reason == "length" and len(small.token_ids) == 5
    assert llm.engine.allocator.num_free == 6
    with pytest.raises(ValueError, match="needs 7 KV blocks"):
        llm.generate([[3] * 26])


def test_max_model_len_edge(tiny_llm_dir):
    llm = _llm(tiny_llm_dir, max_model_len=32)
    out = llm.generate([[5] * 30], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2
    with pytest.raises(ValueError, match="prompt 0: prompt has 32 tokens but max_model_len=32"):
        llm.generate([[5] * 32])
    with pytest.raises(ValueError, match="prompt 1: .*outside the vocabulary"):
        llm.generate([[5], [10 ** 9]])


def test_stop_tokens_and_eos(tiny_llm_dir):
    llm = _llm(tiny_llm_dir)
    free = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    stop = free.token_ids[3]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]


def test_bad_inputs_have_clear_errors(tiny_llm_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="no/such/model"):
        LLM(model="no/such/model")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        LLM(model=str(bad))
    with pytest.raises(ValueError, match="page_size"):
        _llm(tiny_llm_dir, page_size=0)
    with pytest.raises(ValueError, match="max_model_len=100000"):
        _llm(tiny_llm_dir, max_model_len=100000)
    llm = _llm(tiny_llm_dir)
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(["hi"], SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match="got 1 sampling params for 2 prompts"):
        llm.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]])
    # The engine still serves requests after the rejected ones.
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_chat_template_and_text_prompts(tiny_llm_dir):
    llm = _llm(tiny_llm_dir, max_model_len=128)
    conv = [{"role": "user", "content": "hi"}]
    out = llm.chat(conv, SamplingParams(max_tokens=4, temperature=0.0))[0]
    text = llm.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    assert isinstance(out.text, str) and out.metrics.time_to_first_token is not None
    out = llm.generate("hello there", SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.prompt == "hello there" and len(out.token_ids) <= 3


def test_max_num_seqs_bounds_every_batch(tiny_llm_dir):
    """Admission counts the requests admitted in the same step (the static CUDA-graph buffers
    and capture sizes rely on no batch exceeding max_num_seqs)."""
    llm = _llm(tiny_llm_dir, max_num_seqs=2)
    sizes = []
    orig = llm.engine.runner.execute

    def spy(reqs, num_new):
        sizes.append(len(reqs))
        return orig(reqs, num_new)

    llm.engine.runner.execute = spy
    llm.generate(PROMPTS + PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert max(sizes) == 2 and sizes[0] == 2


def test_min_admit_starts_waiting_requests_in_bulk(tiny_llm_dir):
    """min_admit=3: while requests run, waiting ones start only 3 at a time (or all that wait),
    so there are fewer steps with a prompt; outputs do not change."""
    prompts = [PROMPTS[i % 4] + [i] for i in range(10)]
    params = [SamplingParams(max_tokens=3 + (5 * i) % 7, temperature=0.0, ignore_eos=True)
              for i in range(10)]
    ref = _llm(tiny_llm_dir, max_num_seqs=4)
    want = _ids(ref.generate(prompts, params))
    llm = _llm(tiny_llm_dir, max_num_seqs=4, min_admit=3)
    steps = []  # (running before the step, admitted in it, waiting before admission)
    orig = llm.engine.runner.execute

    def spy(reqs, num_new):
        admitted = sum(n > 1 for n in num_new)
        steps.append((len(reqs) - admitted, admitted, len(llm.engine.scheduler.waiting) + admitted))
        return orig(reqs, num_new)

    llm.engine.runner.execute = spy
    assert _ids(llm.generate(prompts, params)) == want
    bulk = [(r, a, w) for r, a, w in steps if r > 0 and a > 0]
    assert bulk and all(a >= min(3, w) for _, a, w in bulk)
    assert llm.stats.num_prefill_steps < ref.stats.num_prefill_steps
    # Slots were left empty while fewer than 3 could start (the price of bulk admission).
    assert any(r < 4 and a == 0 and w > 0 for r, a, w in steps)
    with pytest.raises(ValueError, match="min_admit=0"):
        _llm(tiny_llm_dir, min_admit=0)


def test_scheduler_predicts_its_next_admission(tiny_llm_dir):
    """``Scheduler.admits_next(ending)``: the gate the next ``schedule`` applies, read before
    the step's bookkeeping, for every number of requests ending."""
    from compiled_spec.engine.scheduler import Scheduler

    llm = _llm(tiny_llm_dir, max_num_seqs=8, min_admit=4)
    sp = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eng = llm.engine
    sched: Scheduler = eng.scheduler
    assert not sched.admits_next(0)  # nothing waits
    for i in range(11):
        eng.add_request([1 + i, 2, 3], sp)
    assert sched.admits_next(0)  # nothing runs: all is admitted
    eng.step()
    assert len(sched.running) == 8 and len(sched.waiting) == 3
    # 3 wait: the round waits for min(min_admit, waiting) = 3 free slots
    assert [sched.admits_next(e) for e in range(9)] == [False] * 3 + [True] * 6
    with sched.overriding(min_admit=1):
        assert [sched.admits_next(e) for e in range(3)] == [False, True, True]


def test_min_admit_defaults_to_a_quarter_of_the_batch(tiny_llm_dir):
    """min_admit=None (the default): a backlog is admitted a quarter of max_num_seqs at a time,
    read per step (the bench narrows max_num_seqs per batch size); below 8 sequences, at once."""
    from dataclasses import replace

    from compiled_spec.config import auto_min_admit

    assert [auto_min_admit(n) for n in (1, 4, 7, 8, 16, 64)] == [1, 1, 1, 2, 4, 16]
    prompts = [PROMPTS[i % 4] + [i] for i in range(24)]
    params = [SamplingParams(max_tokens=2 + (3 * i) % 11, temperature=0.0, ignore_eos=True)
              for i in range(24)]
    want = _ids(_llm(tiny_llm_dir, max_num_seqs=16, min_admit=1).generate(prompts, params))
    llm = _llm(tiny_llm_dir, max_num_seqs=16)
    sched = llm.engine.scheduler
    assert sched.cfg.min_admit is None and sched.min_admit == 4
    steps = []  # (running before the step, admitted in it, waiting before admission)
    orig = llm.engine.runner.execute

    def spy(reqs, num_new):
        admitted = sum(n > 1 for n in num_new)
        steps.append((len(reqs) - admitted, admitted, len(sched.waiting) + admitted))
        return orig(reqs, num_new)

    llm.engine.runner.execute = spy
    assert _ids(llm.generate(prompts, params)) == want
    bulk = [(r, a, w) for r, a, w in steps if r > 0 and a > 0]
    assert bulk and all(a >= min(4, w) for _, a, w in bulk), steps
    sched.cfg = replace(sched.cfg, max_num_seqs=4)
    assert sched.min_admit == 1


def test_min_admit_round_goes_on_when_the_token_budget_cuts_it(tiny_llm_dir):
    """A bulk admission cut short by max_num_batched_tokens goes on over the next steps (else
    the slots it did not fill would wait for min_admit of them to free up)."""
    prompts = [PROMPTS[2] + [i] for i in range(8)]  # 41 tokens: one fits a step's budget
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = _ids(_llm(tiny_llm_dir, max_num_seqs=4).generate(prompts, sp))
    llm = _llm(tiny_llm_dir, max_num_seqs=4, min_admit=4, max_num_batched_tokens=45)
    sizes = []
    orig = llm.engine.runner.execute

    def spy(reqs, num_new):
        sizes.append((len(reqs), sum(n > 1 for n in num_new)))
        return orig(reqs, num_new)

    llm.engine.runner.execute = spy
    assert _ids(llm.generate(prompts, sp)) == want
    assert sizes[:4] == [(1, 1), (2, 1), (3, 1), (4, 1)]
