"""Helpers shared by the engine tests that compare generation paths token for token."""
from __future__ import annotations

from compiled_spec import LLM, SamplingParams


def generate_in_batches(llm: LLM, prompts: list[list[int]], sps: list[SamplingParams],
                        batch: int) -> list[list[int]]:
    """Each request's output tokens, the requests run ``batch`` at a time in order."""
    out = []
    for i in range(0, len(prompts), batch):
        res = llm.generate(prompts[i:i + batch], sps[i:i + batch], use_tqdm=False)
        out += [o.outputs[0].token_ids for o in res]
    return out
