"""compiled_spec.own_code: each engine's compiled methods keep their own Dynamo cache.

The regression: an EAGLE-3 chain engine and then an EAGLE-1 chain engine in one process. The
second engine's pick + plan recompiled with the first engine's entries on the same code object,
and torch's recompilation-reason analysis raised KeyError('d2t') on the first entry's guard
sources: its early-propose graphs failed to capture (strict capture raised)."""
from __future__ import annotations

from pathlib import Path

import torch

from compiled_spec.own_code import own_code


class _Counter:
    def __init__(self, step: int) -> None:
        self.step = step

    def add(self, x: int, *, times: int = 1) -> int:
        return x + self.step * times


def test_a_bound_method_gets_a_code_object_of_its_own() -> None:
    a, b = _Counter(2), _Counter(3)
    ma, mb = own_code(a.add), own_code(b.add)
    assert ma(1) == 3 and mb(1, times=2) == 7  # same behaviour, bound to the same instance
    assert ma.__self__ is a and ma.__name__ == "add" and ma.__qualname__ == "_Counter.add"
    codes = {id(ma.__func__.__code__), id(mb.__func__.__code__), id(_Counter.add.__code__)}
    assert len(codes) == 3  # one per call, none the class's
    assert ma.__func__.__code__ == _Counter.add.__code__  # equal content
    module = torch.nn.Linear(2, 2)
    assert own_code(module) is module  # modules (compiled through forward) are left alone
    assert own_code(len) is len


def test_an_eagle1_engine_after_an_eagle3_engine_captures_its_graphs(tmp_path: Path,
                                                                      smollm2_gguf_path) -> None:
    from capture import CapturePolicy
    from compiled_spec import LLM, SamplingParams
    from compiled_spec.compile import CompileConfig, capture_graphs, compile_models
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.loader import read_model_config
    from tests.spec_models import write_bigram_target, write_mirror_eagle1

    target = write_bigram_target(tmp_path / "t", vocab=64, hidden=32, layers=2)
    head3 = write_eagle3_head(str(tmp_path / "e3"), read_model_config(target),
                              draft_vocab_size=48, aux_layer_ids=(0, 1, 2))
    head1 = write_mirror_eagle1(tmp_path / "e1", target, noise=0.3)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = []
    for head in (head3, head1):
        llm = LLM(model=target, tokenizer=smollm2_gguf_path, draft=head, max_model_len=64,
                  max_num_seqs=2, dtype="float32", num_speculative_tokens=2)
        models = compile_models(llm.engine.runner, CompileConfig(inductor=False))
        llm._compiled = models
        policy = CapturePolicy(max_batch_size=2, num_speculative_tokens=2, max_model_len=64,
                               batch_sizes=(1, 2), seq_len_buckets=(64,))
        # strict: a failed capture (the KeyError above) raises instead of being counted
        graphs = capture_graphs(llm.engine.runner, models, policy, llm.config.cache.page_size,
                                emulate=True, strict=True)
        assert graphs.propose_early is not None and graphs.propose_early.captured_sizes
        outs.append([o.outputs[0].token_ids for o in llm.generate([[3, 7, 1], [5]], sp,
                                                                   use_tqdm=False)])
        assert "compile_failures" not in models.stats(), models.stats()
    assert outs[0] == outs[1]  # the same target, greedy: the heads only change acceptance
