"""Checking one request against the engine's limits before anything is queued: its sampling
parameters, its prompt's token ids (type and vocabulary), and room for it in ``max_model_len``
and in the whole KV pool. ``LLMEngine.check_request`` is the engine's face of it."""
from __future__ import annotations

from compiled_spec.kv_cache import BlockAllocator
from compiled_spec.sampling_params import SamplingParams, as_int


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab: int,
                     max_model_len: int, allocator: BlockAllocator) -> list[int]:
    """Raise ValueError naming what is wrong with a request; touches no state. Returns the
    prompt as Python ints (numpy integers are token ids too; booleans are not)."""
    require_params(params).validate()  # again: fields may have been changed since construction
    return validate_prompt(prompt_token_ids, vocab, max_model_len, allocator)


def require_params(params: object) -> SamplingParams:
    """``params`` itself, or a ValueError naming its type when it is not SamplingParams."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
    return params


def validate_prompt(prompt_token_ids: list[int], vocab: int, max_model_len: int,
                    allocator: BlockAllocator) -> list[int]:
    """``validate_request``'s prompt half: the token ids' types and vocabulary, and room for
    the prompt in ``max_model_len`` and the KV pool. Returns the prompt as Python ints."""
    if isinstance(prompt_token_ids, (str, bytes)) or not hasattr(prompt_token_ids, "__len__"):
        raise ValueError(f"a token-id prompt must be a list of ints, got "
                         f"{type(prompt_token_ids).__name__}")
    n = len(prompt_token_ids)
    if n == 0:
        raise ValueError("prompt is empty: give at least one token")
    # A prompt's every token, twice per request (generate checks, add_request checks
    # again): plain ints (nearly always) are checked by C loops (types, then min and max),
    # ~20% cheaper than one Python pass; anything else takes that pass, per token.
    bad: list = []
    if set(map(type, prompt_token_ids)) == {int}:
        ids = list(prompt_token_ids)
        if not (0 <= min(ids) and max(ids) < vocab):
            bad = [t for t in ids if not 0 <= t < vocab]
    else:
        ids = [t if type(t) is int else as_int(t) for t in prompt_token_ids]
        bad = [t for t, i in zip(prompt_token_ids, ids) if i is None or not 0 <= i < vocab]
    if bad:
        what = "is not an integer" if as_int(bad[0]) is None else "is outside the vocabulary"
        raise ValueError(f"prompt token id {bad[0]!r} {what} [0, {vocab})")
    if n >= max_model_len:
        raise ValueError(f"prompt has {n} tokens but max_model_len={max_model_len} "
                         f"leaves no room for output (prompt must be shorter than max_model_len)")
    need = allocator.blocks_for(n + 1)
    if need > allocator.num_blocks:
        raise ValueError(f"prompt of {n} tokens needs {need} KV blocks of {allocator.page_size} "
                         f"tokens, but the whole pool has {allocator.num_blocks}")
    return ids  # type: ignore[return-value]  # every entry checked above
