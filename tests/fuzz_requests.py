"""Random requests, good and bad, for the fuzz test and the soak (profiles/soak_cpu.py): seeded,
so a failure replays. A "bad" request must be refused by validation with a ValueError; a
request with ``FAULT_SEED`` passes validation but makes the (wrapped) runner raise mid-step."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from compiled_spec import SamplingParams

FAULT_SEED = 666_000_666

_GOOD = {
    "max_tokens": [1, 2, 5, 16, 40],
    "temperature": [0.0, 0.0, 0.5, 1.0, 1.7, np.float32(0.8)],
    "top_k": [0, 0, 1, 5, 50, 2 ** 31 - 1],
    "top_p": [1.0, 1.0, 0.9, 0.3, 1e-6],
    "min_p": [0.0, 0.0, 0.1, 1.0],
    "seed": [None, 0, 1, 12345, -7, 2 ** 63 - 1, -(2 ** 63), np.int64(99)],
    "stop_token_ids": [[], [], None, [3], (5, 7), [63]],
    "ignore_eos": [False, True],
    "speculate": [True, True, False],
    "n": [1, 1, 1, 2, 3],
    "stop": [[], [], None, "!", ["\n", "#$"]],
    "logprobs": [None, None, 0, 2],
}
_BAD = {
    "max_tokens": [0, -1, True, 2.5, "8", None],
    "temperature": [-0.1, math.inf, math.nan, True, "hot", None],
    "top_k": [-1, 2 ** 31, 2 ** 63, True, 1.5],
    "top_p": [0.0, 1.5, math.nan, True],
    "min_p": [-0.1, 1.1, math.nan],
    "seed": [2 ** 63, -(2 ** 63) - 1, True, 1.0, "1"],
    "stop_token_ids": [[True], [-1], 5, "ab", [1.5]],
    "ignore_eos": [1, None],
    "speculate": [0, "yes"],
    "n": [0, True, 2000],
    "stop": [[""], 5, ["a", None]],
    "logprobs": [-1, 21, True],
}


@dataclass
class FuzzRequest:
    prompt: object
    params: SamplingParams | None  # None: construction itself was refused
    bad: bool  # validation must refuse it
    fault: bool = False  # passes validation, raises inside a step


def random_prompt(rng: random.Random, vocab: int, max_len: int, bad: bool) -> object:
    if bad:
        return rng.choice([[], [vocab], [-1], [1, True], 3.5, None, [1, 2.0],
                           [1] * max_len, {"a": 1}])
    ids = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len // 3))]
    form = rng.random()
    if form < 0.15:
        return tuple(ids)
    if form < 0.3:
        return np.array(ids, dtype=np.int64)
    return ids


def random_request(rng: random.Random, vocab: int, max_len: int,
                   p_bad: float = 0.15, p_fault: float = 0.05) -> FuzzRequest:
    kw = {k: rng.choice(v) for k, v in _GOOD.items() if rng.random() < 0.6}
    bad = rng.random() < p_bad
    bad_prompt = bad and rng.random() < 0.4
    mutate = None
    if bad and not bad_prompt:
        field = rng.choice(list(_BAD))
        value = rng.choice(_BAD[field])
        if rng.random() < 0.3:  # valid at construction, broken afterwards
            mutate = (field, value)
        else:
            kw[field] = value
    prompt = random_prompt(rng, vocab, max_len, bad_prompt)
    fault = not bad and rng.random() < p_fault
    if fault:
        kw["seed"] = FAULT_SEED
    try:
        sp = SamplingParams(**kw)
    except ValueError:
        return FuzzRequest(prompt, None, True)
    if mutate is not None:
        setattr(sp, *mutate)
    return FuzzRequest(prompt, sp, bad, fault)


def inject_faults(llm) -> None:  # noqa: ANN001 - an LLM
    """Wrap the runner so that a step holding a FAULT_SEED request raises (in execute or in
    propose, alternately): a fault that validation cannot see."""
    runner = llm.engine.runner
    for name in ("execute", "propose"):
        orig = getattr(runner, name)

        def wrapped(reqs, *args, _orig=orig, _name=name):
            for r in reqs:
                if r.params.seed == FAULT_SEED and (r.req_id % 2 == 0) == (_name == "execute"):
                    raise RuntimeError(f"injected fault in {_name}")
            return _orig(reqs, *args)

        setattr(runner, name, wrapped)
