"""``emit_count`` (a step's tokens appended in one go, no stop strings) against the per-token
rule it replaces: append each token, then ``stop_reason``."""
import random

from compiled_spec.engine.request import Request
from compiled_spec.engine.stopping import emit_count, stop_reason
from compiled_spec.sampling_params import SamplingParams

EOS = {2}


def _per_token(req: Request, toks: list[int], max_len: int) -> tuple[int, str | None]:
    for j, tok in enumerate(toks):
        req.output_token_ids.append(tok)
        reason = stop_reason(req, tok, EOS, max_len, lambda ids, skip: "")
        if reason is not None:
            return j + 1, reason
    return len(toks), None


def test_emit_count_equals_the_per_token_rule():
    rng = random.Random(0)
    seen = set()
    for _ in range(4000):
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.3,
                                stop_token_ids=rng.choice([[], [5], [5, 7]]))
        prompt = [1] * rng.randint(1, 6)
        out = [rng.randint(0, 9) for _ in range(rng.randint(0, params.max_tokens - 1))]
        max_len = rng.randint(len(prompt) + len(out) + 1, 24)
        toks = [rng.randint(0, 9) for _ in range(rng.randint(1, 6))]
        req = Request(0, prompt, params, 0, min(len(prompt) + params.max_tokens, max_len),
                      output_token_ids=list(out))
        got = emit_count(req, toks, EOS, max_len)
        assert req.output_token_ids == out  # it appends nothing itself
        want = _per_token(req, toks, max_len)
        assert got == want, (params, prompt, out, max_len, toks)
        seen.add(want[1])
    assert seen == {None, "stop", "length"}  # every outcome was exercised
