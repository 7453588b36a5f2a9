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


def test_op_table_self_times_from_a_written_trace(tmp_path):
    """op_table's self CPU times (an op's time less its child ops') from a hand-written trace,
    kernels by device time, and the top op of a real trace as key_averages ranks it."""
    import json

    from compiled_spec.profile import op_table

    ev = [dict(ph="X", cat="cpu_op", pid=1, tid=1, name=n, ts=ts, dur=d) for n, ts, d in
          [("outer", 0, 100), ("inner", 10, 30), ("inner", 50, 20), ("leaf", 55, 5),
           ("outer", 200, 10)]]
    ev += [dict(ph="X", cat="kernel", pid=0, tid=7, name="gemm", ts=5, dur=40),
           dict(ph="X", cat="kernel", pid=0, tid=7, name="gemm", ts=60, dur=2)]
    path = tmp_path / "t.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    rows = {line.split()[0]: line.split()[1:] for line in
            op_table(str(path), 10, device=False).splitlines()[1:]}
    # outer: 100 - 30 - 20 + 10 = 60 us over 2 calls; inner: 30 + 20 - 5 = 45 us; leaf: 5
    assert rows == {"outer": ["2", "0.060", "54.5", "30.0"],
                    "inner": ["2", "0.045", "40.9", "22.5"],
                    "leaf": ["1", "0.005", "4.5", "5.0"]}, rows
    dev = op_table(str(path), 10, device=True).splitlines()
    assert "Self device" in dev[0] and dev[1].split()[:3] == ["gemm", "2", "0.042"]

    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                                    str(tmp_path / "real"))) as prof:
        for _ in range(20):
            torch.nn.functional.softmax(x @ x, dim=-1).sum()
    (trace,) = glob.glob(str(tmp_path / "real" / "*.pt.trace.json"))
    ours = {line.split()[0]: (int(line.split()[1]), float(line.split()[2]))
            for line in op_table(trace, 50, device=False).splitlines()[1:]}
    theirs = {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()}
    # (key_averages folds an op into a same-named parent, aten::sum's two levels: left out)
    for op in ("aten::matmul", "aten::mm", "aten::softmax", "aten::_softmax"):
        assert ours[op][0] == theirs[op][0] == 20, op
        assert abs(ours[op][1] - theirs[op][1]) <= 0.01 + 0.02 * theirs[op][1], (op, ours, theirs)
