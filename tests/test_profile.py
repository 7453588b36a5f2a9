"""Profiler ranges: the engine's phases appear in a torch.profiler trace and are read back."""
import glob

import torch

from compiled_spec import LLM, SamplingParams
from compiled_spec.profile import phase_latencies
from tests.spec_models import write_bigram_target, write_mirror_eagle1


def test_trace_has_phase_ranges(tmp_path, smollm2_gguf_path):
    target = write_bigram_target(tmp_path / "t")
    head = write_mirror_eagle1(tmp_path / "d", target)
    llm = LLM(model=target, tokenizer=smollm2_gguf_path, draft=head, num_speculative_tokens=3,
              max_model_len=64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                on_trace_ready=torch.profiler.tensorboard_trace_handler(str(tmp_path / "tr"))):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    (trace,) = glob.glob(str(tmp_path / "tr" / "*.pt.trace.json"))
    lat = phase_latencies(trace)
    steps = llm.stats.num_steps
    assert lat["verify"]["count"] == steps and lat["prepare"]["count"] == steps
    assert lat["rejection_sample"]["count"] == steps
    assert lat["propose"]["count"] == steps - 1  # the finishing step proposes nothing
    assert 0 < lat["propose"]["p50"] <= lat["propose"]["p90"]
