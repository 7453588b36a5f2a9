"""Dummy requests at start-up through the paths that run outside CUDA graphs.

Capture compiles and records the decode / verify / propose graphs, but a step with a prompt runs
the compiled target and draft callables directly, with shapes no capture met: a prompt's token
count, one sequence (Dynamo specialises sizes 0 and 1) or several, the draft's first pass over
a prompt. Each such class compiled on first use, inside a user's request: the first request of
a fresh EAGLE-3 engine on the H200 took 25.3 s (session 21), the second 1.4 s, the rest ~0.06 s.
So start-up sends requests of dummy tokens through the real engine loop (one request alone, then
a batch of several with one admitted beside running ones, greedy, sampled and with logprobs, then
that batch again with the early paths off) and then zeroes
every counter, so that ``llm.stats`` and graph statistics count users' requests only.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from compiled_spec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from compiled_spec.engine.engine import LLMEngine

log = logging.getLogger(__name__)


def _prompt(n: int, vocab: int, salt: int) -> list[int]:
    # Ids from 1 up (0 is often a special token); the salt keeps prompts apart so that no
    # prefix-cache hit skips a prefill.
    return [1 + (salt * 7 + 3 * i) % max(1, vocab - 1) for i in range(n)]


def warm_requests(max_model_len: int, page_size: int, lookahead: int, max_num_seqs: int,
                  vocab: int, salt: int = 0) -> list[list[tuple[list[int], SamplingParams]]]:
    """Rounds of (prompt, params): one request alone, then (with room for two) four
    requests at most two at a time, of different lengths and budgets, so that a prompt is
    admitted beside a running request. Lengths fit ``max_model_len`` with the speculative
    lookahead; each request decodes past one full drafting step."""
    decode = lookahead + 3
    room = max_model_len - 2 * decode - lookahead - 1  # the longest budget below is 2 x decode
    if room < 2:
        return []
    lengths = [min(room, n) for n in (2 * page_size + 3, page_size + 1, 3 * page_size - 1, 5)]
    greedy = SamplingParams(max_tokens=decode, temperature=0.0, ignore_eos=True)
    longer = SamplingParams(max_tokens=2 * decode, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=decode, temperature=0.8, top_p=0.9, seed=0,
                             ignore_eos=True)
    with_lp = SamplingParams(max_tokens=decode, temperature=0.8, seed=1, logprobs=1,
                             ignore_eos=True)
    rounds = [[(_prompt(lengths[0], vocab, salt), greedy)]]
    if max_num_seqs >= 2:
        rounds.append([(_prompt(lengths[1], vocab, salt + 1), greedy),
                       (_prompt(lengths[2], vocab, salt + 2), longer),
                       (_prompt(lengths[3], vocab, salt + 3), sampled),
                       (_prompt(lengths[0], vocab, salt + 4), with_lp)])
    return rounds


def warm_uncaptured_paths(engine: LLMEngine) -> float:
    """Run ``warm_requests`` through ``engine`` (at most two running at once, each freed slot
    filled at once), then reset its counters. Returns the seconds taken."""
    t0 = time.perf_counter()
    cfg, sched = engine.cfg, engine.scheduler
    args = (cfg.max_model_len, cfg.cache.page_size, sched.lookahead,
            cfg.scheduler.max_num_seqs, engine.model.config.vocab_size)
    rounds = [(r, True) for r in warm_requests(*args)]
    # The last round again with the early paths off: the late acceptance and proposal (which
    # a mixed tree step, a step near max_model_len or one short of KV run) have their first
    # launches here, not in a user's step. Sampled requests and logprobs kept those steps
    # late at start-up before the fifty-third session; now they take the early paths too.
    early = getattr(engine.runner, "early", None)
    if early is not None and early.enabled and len(rounds) > 1:
        rounds.append((warm_requests(*args, salt=8)[-1], False))
    with sched.overriding(max_num_seqs=min(2, sched.cfg.max_num_seqs), min_admit=1):
        for batch, early_on in rounds:
            if early is not None:
                early.enabled = early_on
            try:
                why = _run_round(engine, batch)
            finally:
                if early is not None:
                    early.enabled = True
            if why is not None:
                return _stop(engine, t0, why)
    return _done(engine, t0)


def _run_round(engine: LLMEngine, batch: list[tuple[list[int], SamplingParams]]) -> str | None:
    """One round's requests to their end; why it stopped short, or None."""
    try:
        for ids, params in batch:
            engine.add_request(ids, params)
    except ValueError as e:  # a KV pool too small for it, say
        return str(e)
    while engine.has_unfinished():
        aborted = [r for r in engine.step() if r.finish_reason == "abort"]
        if aborted:
            return aborted[0].error or "aborted"
    return None


def _stop(engine: LLMEngine, t0: float, why: str) -> float:
    """A dummy request the engine cannot run: the engine still works, and the shapes left out
    compile in the first requests that meet them (counted in compiled_after_startup)."""
    log.warning("start-up's dummy requests stopped (%s): the first requests may compile", why)
    engine.abort({r.req_id for r in engine.scheduler.running}
                 | {r.req_id for r in engine.scheduler.waiting}, "start-up warm-up stopped")
    return _done(engine, t0)


def _done(engine: LLMEngine, t0: float) -> float:
    engine.runner.reset()  # no drafts or verify-ahead launch of a dummy request carries over
    engine.reset_stats()
    return time.perf_counter() - t0
