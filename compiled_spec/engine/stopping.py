"""When a request stops, and the text it returns: EOS / stop token ids, stop strings,
max_tokens and max_model_len.

Stop strings are matched on the detokenized output after every emitted token, accepted drafts
included one by one, so a speculative request stops on exactly the token vanilla decoding
stops on and drops the drafts accepted after it. The returned text ends before the earliest
stop string (as vLLM's default); the token ids keep the token that completed it.
"""
from __future__ import annotations

from typing import Callable

from compiled_spec.engine.request import Request

Detokenize = Callable[[list[int], bool], str]


def first_stop_string(text: str, stops: list[str]) -> int | None:
    """Index in ``text`` where the earliest of ``stops`` begins, None when none occurs."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def stops_on_token(req: Request, tok: int, eos_token_ids: set[int]) -> bool:
    """Whether emitting ``tok`` stops ``req`` by its id alone: EOS (unless ignored) or one of
    its stop token ids."""
    p = req.params
    return (not p.ignore_eos and tok in eos_token_ids) or tok in p.stop_token_ids


def stop_reason(req: Request, tok: int, eos_token_ids: set[int], max_model_len: int,
                detokenize: Detokenize) -> str | None:
    """Why ``req`` stops after emitting ``tok`` (already appended), or None."""
    p = req.params
    if stops_on_token(req, tok, eos_token_ids):
        return "stop"
    # The whole output is decoded, not a tail: a token's text can depend on its neighbours.
    if p.stop and first_stop_string(detokenize(req.output_token_ids, p.skip_special_tokens),
                                    p.stop) is not None:
        return "stop"
    if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None


def emit_count(req: Request, toks: list[int], eos_token_ids: set[int],
               max_model_len: int) -> tuple[int, str | None]:
    """For a request without stop strings: how many of ``toks`` (not yet appended) it emits,
    and why it stops after the last of them (None: it goes on). Equal to appending ``toks`` one
    by one and calling ``stop_reason`` after each; one pass without the per-token calls, which
    at batch 64 x (k + 1) tokens a step showed in the step's host time."""
    p = req.params
    # Tokens it may emit up to a length limit, the one reaching it included (>= 1: a token
    # is appended before any check).
    room = max(1, min(p.max_tokens - len(req.output_token_ids),
                      max_model_len - len(req.prompt_token_ids) - len(req.output_token_ids)))
    eos = () if p.ignore_eos else eos_token_ids
    ids = p.stop_token_ids
    for j, tok in enumerate(toks):
        if tok in eos or tok in ids:
            return (j + 1, "stop") if j < room else (room, "length")
    if len(toks) >= room:
        return room, "length"
    return len(toks), None


def output_text(req: Request, detokenize: Detokenize) -> str:
    text = detokenize(req.output_token_ids, req.params.skip_special_tokens)
    if req.finish_reason == "stop" and req.params.stop:
        cut = first_stop_string(text, req.params.stop)
        if cut is not None:
            text = text[:cut]
    return text
