"""Helpers shared by the engine tests that compare generation paths token for token."""
from __future__ import annotations

from capture import CapturePolicy
from compiled_spec import LLM, SamplingParams
from compiled_spec.compile import CompileConfig, capture_graphs, compile_models


def generate_in_batches(llm: LLM, prompts: list[list[int]], sps: list[SamplingParams],
                        batch: int) -> list[list[int]]:
    """Each request's output tokens, the requests run ``batch`` at a time in order."""
    out = []
    for i in range(0, len(prompts), batch):
        res = llm.generate(prompts[i:i + batch], sps[i:i + batch], use_tqdm=False)
        out += [o.outputs[0].token_ids for o in res]
    return out


def with_emulated_graphs(llm: LLM, k: int, max_model_len: int = 128,
                         prefill_sizes: tuple[int, ...] = (), mixed_sizes: tuple[int, ...] = (),
                         mixed_query_len: int = 0) -> LLM:
    """``llm`` compiled (our passes, no Inductor) with CPU stand-ins for its CUDA graphs at
    batch sizes 1, 2, 4 (and one-sequence prompt steps of ``prefill_sizes`` tokens, several
    sequences' of ``mixed_sizes``): the engine's graph paths (early propose, verify ahead) on
    the CPU."""
    models = compile_models(llm.engine.runner, CompileConfig(inductor=False))
    llm._compiled = models
    policy = CapturePolicy(max_batch_size=4, num_speculative_tokens=k,
                           max_model_len=max_model_len, batch_sizes=(1, 2, 4),
                           seq_len_buckets=(max_model_len,), prefill_sizes=prefill_sizes,
                           mixed_sizes=mixed_sizes, mixed_query_len=mixed_query_len)
    capture_graphs(llm.engine.runner, models, policy, 4, emulate=True)
    return llm


def assert_same_logprobs(got: list, want: list, tol: float = 1e-4) -> None:
    """Two runs' RequestOutputs (in order): the same tokens, and per token the same keys with
    log-probabilities within ``tol`` (None where a request asked for none)."""
    import math

    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        a, b = g.outputs[0].logprobs, w.outputs[0].logprobs
        assert (a is None) == (b is None)
        for da, db in zip(a or [], b or []):
            assert da.keys() == db.keys(), (da, db)
            assert all(math.isclose(da[t], db[t], abs_tol=tol) for t in da), (da, db)


def logprob_params(seed: int, budgets: tuple[int, int, int]) -> list[SamplingParams]:
    """Three requests: greedy with logprobs=2, greedy without, sampled (T 0.9) with logprobs=1;
    seeds from ``seed``."""
    kinds = [(2, 0.0), (None, 0.0), (1, 0.9)]
    return [SamplingParams(max_tokens=m, ignore_eos=True, seed=seed + i, logprobs=lp,
                           temperature=t) for i, (m, (lp, t)) in enumerate(zip(budgets, kinds))]
