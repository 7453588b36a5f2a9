"""profiles/scripts/trace_gaps.py on a hand-made trace whose gaps and causes are known."""
import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "profiles" / "scripts" / "trace_gaps.py"
_spec = importlib.util.spec_from_file_location("trace_gaps", _PATH)
tg = importlib.util.module_from_spec(_spec)
sys.modules["trace_gaps"] = tg  # its dataclasses look their module up there
_spec.loader.exec_module(tg)


def _host(cat, name, ts, dur, corr=None):
    e = {"ph": "X", "cat": cat, "name": name, "pid": 9, "tid": 9, "ts": ts, "dur": dur}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _gpu(cat, name, ts, dur, corr):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"correlation": corr}}


def _trace():
    """Step 0 = [0, 1000) us: an eager index_select in prepare, a verify graph, a D2H read, a
    propose graph, then host Python with nothing queued; step 1 = [1000, 1050)."""
    ev = [_host("user_annotation", "prepare", 0, 100),
          _host("cpu_op", "aten::index_select", 10, 30),
          _host("cuda_runtime", "cudaLaunchKernel", 20, 10, corr=1),
          _host("user_annotation", "verify", 100, 300),
          _host("cuda_runtime", "cudaGraphLaunch", 110, 90, corr=2),
          _host("user_annotation", "rejection_sample", 400, 100),
          _host("cuda_runtime", "cudaMemcpyAsync", 400, 80, corr=3),
          _host("user_annotation", "propose", 500, 200),
          _host("cuda_runtime", "cudaGraphLaunch", 600, 10, corr=4),
          _host("user_annotation", "prepare", 1000, 50),
          _gpu("kernel", "index_kernel", 35, 10, 1),
          _gpu("kernel", "verify_a", 205, 95, 2), _gpu("kernel", "verify_b", 302, 168, 2),
          _gpu("gpu_memcpy", "Memcpy DtoH (Device -> Pageable)", 470, 5, 3),
          _gpu("kernel", "draft", 612, 288, 4),
          {"ph": "X", "cat": "gpu_user_annotation", "name": "verify", "pid": 0, "tid": 7,
           "ts": 205, "dur": 265}]
    return {"traceEvents": ev + [{"ph": "M", "name": "process_name", "pid": 0}]}


def test_gaps_and_causes(tmp_path):
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    tr = tg.Trace(tg.load(str(path)))
    assert tr.marker == "prepare"
    s0, s1 = tr.steps(min_gap=5.0)
    assert (s0.start, s0.end, s1.start, s1.end) == (0, 1000, 1000, 1050)
    assert s0.busy == pytest.approx(10 + 95 + 168 + 5 + 288)
    assert s0.idle == pytest.approx(35 + 160 + 2 + 137 + 100)  # the 2 us gap is counted ...
    assert [round(g.dur) for g in s0.gaps] == [35, 160, 137, 100]  # ... but not listed
    g0, g1, g2, g3 = s0.gaps
    assert dict(g0.causes) == pytest.approx({"python prepare": 10, "eager launch": 10,
                                             "aten aten::index_select": 15})
    assert dict(g1.causes) == pytest.approx({"python prepare": 55, "python verify": 15,
                                             "graph launch": 90})
    assert g1.next_op.startswith("verify_a <- cudaGraphLaunch")
    assert dict(g2.causes) == pytest.approx({"sync (D2H copy)": 5, "python rejection_sample": 20,
                                             "python propose": 102, "graph launch": 10})
    assert g2.gpu_phase == "-" and g1.gpu_phase == "-"
    assert dict(g3.causes) == pytest.approx({"python (no annotation)": 100})
    # Work launched outside a graph is eager, under the aten op around its launch (else the
    # annotation): the graphs' kernels are not.
    assert dict(s0.eager) == pytest.approx({"aten::index_select": 10,
                                            "(rejection_sample: cudaMemcpyAsync)": 5})
    assert s0.graph_launch_us == [90, 10]
    assert dict(s1.host) == pytest.approx({"python prepare": 50})
    summ = tg.summarize([s0])
    assert summ["mean"]["idle_without_graph_launch_us"] == pytest.approx(434 - 100)
    grouped = tg._grouped(summ["idle_by_cause_us"])
    assert grouped["host python"] == pytest.approx(10 + 55 + 15 + 20 + 102 + 100)
    assert grouped["eager ops (host side)"] == pytest.approx(25)
    assert grouped["sync"] == pytest.approx(5)
    assert grouped["gaps <= min-gap (GPU-side, kernel to kernel)"] == pytest.approx(2)


def test_marker_falls_back_to_verify_and_missing_marker_raises():
    ev = [e for e in _trace()["traceEvents"] if e.get("name") != "prepare"]
    tr = tg.Trace(tg.load({"traceEvents": ev}))
    assert tr.marker == "verify" and tr.bounds[0] == 100
    with pytest.raises(ValueError, match="no 'decode'"):
        tg.Trace(tg.load({"traceEvents": ev}), marker="decode")


def test_marker_is_verify_where_prepare_marks_fewer_steps():
    """An engine launching its steps ahead marks ``prepare`` on its late steps only: steps
    are then bounded by ``verify``, which every step marks."""
    ev = _trace()["traceEvents"]
    verify = next(e for e in ev if e.get("cat") == "user_annotation" and e["name"] == "verify")
    more = [dict(verify, ts=verify["ts"] + shift) for shift in (2000, 3000)]
    tr = tg.Trace(tg.load({"traceEvents": ev + more}))  # prepare 2, verify 3
    assert tr.marker == "verify" and tr.bounds[:3] == [100, 2100, 3100]
