"""Fault isolation: a step that raises aborts only the request at fault, frees every KV block it
held and leaves the engine usable; an interrupted generate() leaves nothing queued; calls from
two threads take turns. Faults are injected into the runner (validation stops the known ones)."""
import threading

import pytest

from compiled_spec import SamplingParams

BAD_SEED = 666  # the injected fault fires for requests with this seed


@pytest.fixture(scope="module")
def tiny_llm_dir(tmp_path_factory):
    """A small-vocabulary target: seeded sampling over SmolLM2's 49k vocabulary costs ~0.2 s
    per CPU step, over 64 tokens nothing."""
    from tests.spec_models import write_bigram_target

    return write_bigram_target(tmp_path_factory.mktemp("bigram"), vocab=64, seed=3)


def LLM(**kw):  # noqa: N802 - the real LLM with this module's defaults
    from compiled_spec import LLM as _LLM
    from compiled_spec.models.gguf_loader import find_default_gguf

    kw.setdefault("tokenizer", find_default_gguf())
    return _LLM(**kw)


def _sp(seed: int, n: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, seed=seed, ignore_eos=True)


PROMPTS = [[5, 17, 30, 42], [7] * 3, list(range(10, 30)), [9, 8]]


def _full(llm) -> bool:
    a = llm.engine.allocator
    return a.num_free == a.num_blocks and not a.tables and not llm.engine.has_unfinished()


def _inject(llm, where: str, exc: BaseException, when=None) -> None:
    """Make runner.<where> raise ``exc`` when a request with BAD_SEED is in it (or when
    ``when(call_number)``)."""
    orig = getattr(llm.engine.runner, where)
    calls = [0]

    def wrapped(reqs, *args):
        calls[0] += 1
        hit = when(calls[0]) if when else any(r.params.seed == BAD_SEED for r in reqs)
        if hit:
            raise exc
        return orig(reqs, *args)

    setattr(llm.engine.runner, where, wrapped)


@pytest.mark.parametrize("where", ["execute", "propose"])
def test_fault_aborts_only_the_request_at_fault(tiny_llm_dir, where):
    llm = LLM(model=tiny_llm_dir, max_model_len=64, page_size=4, max_num_seqs=8)
    seeds = [1, BAD_SEED, 2, 3]
    solo = [llm.generate([p], _sp(s))[0].token_ids for p, s in zip(PROMPTS, seeds)]
    _inject(llm, where, RuntimeError("injected"))
    outs = llm.generate(PROMPTS, [_sp(s) for s in seeds])
    assert outs[1].finish_reason == "abort" and "RuntimeError: injected" in outs[1].outputs[0].error
    for i in (0, 2, 3):  # retried alone after the failed step, recomputed: same tokens
        assert outs[i].finish_reason == "length" and outs[i].token_ids == solo[i]
    assert llm.stats.num_step_faults >= 2 and _full(llm)
    assert llm.generate([PROMPTS[0]], _sp(1))[0].token_ids == solo[0]  # still usable


def test_fault_isolation_with_eagle3(bigram_eagle3):
    target, head = bigram_eagle3
    llm = LLM(model=target, draft=head, num_speculative_tokens=3,
              max_model_len=64, page_size=4)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    seeds = [1, BAD_SEED, 2]
    solo = [llm.generate([p], _sp(s, 12))[0].token_ids for p, s in zip(prompts, seeds)]
    _inject(llm, "propose", RuntimeError("draft broke"))
    outs = llm.generate(prompts, [_sp(s, 12) for s in seeds])
    assert [o.finish_reason for o in outs] == ["length", "abort", "length"]
    assert [outs[0].token_ids, outs[2].token_ids] == [solo[0], solo[2]]
    assert _full(llm)


def test_interrupt_cleans_up_and_next_call_is_clean(tiny_llm_dir):
    llm = LLM(model=tiny_llm_dir, max_model_len=64, page_size=4)
    want = llm.generate([PROMPTS[1]], _sp(5))[0].token_ids
    orig = llm.engine.runner.execute
    _inject(llm, "execute", KeyboardInterrupt(), when=lambda n: n == 3)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, _sp(4, 20))
    assert _full(llm)  # nothing left queued, every block back
    llm.engine.runner.execute = orig
    outs = llm.generate([PROMPTS[1]], _sp(5))
    assert len(outs) == 1 and outs[0].token_ids == want


def test_two_threads_take_turns(tiny_llm_dir):
    llm = LLM(model=tiny_llm_dir, max_model_len=64, page_size=4, max_num_seqs=2)
    sps = [_sp(s, 12) for s in range(len(PROMPTS))]
    want = [o.token_ids for o in llm.generate(PROMPTS, sps)]
    got: dict[int, list] = {}
    errors: list[BaseException] = []

    texts = ["#$%", "0123"]  # ids below the tiny vocabulary
    want_text = [o.token_ids for o in llm.generate(texts, sps[:2])]  # the tokenizer is shared too

    def worker(t: int) -> None:
        try:
            for _ in range(3):
                got.setdefault(t, []).append([o.token_ids for o in llm.generate(PROMPTS, sps)])
                assert [o.token_ids for o in llm.generate(texts, sps[:2])] == want_text
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert all(r == want for rs in got.values() for r in rs) and len(got) == 2
    assert _full(llm)
