"""``kernels.bench_gemm`` on the CPU: the dry run (tiny shapes, Triton interpreter, in a
subprocess) goes through every section and writes its JSON and markdown; section time limits
skip with a note; the report's arithmetic (speed-ups, the per-layer sum) on made-up rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from kernels.bench_gemm import LAYER_GEMMS, main, markdown
from tests.triton_interpret import REPO_ROOT


def test_dry_run_writes_every_section(tmp_path) -> None:
    out = tmp_path / "gemm.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, "-m", "kernels.bench_gemm", "--dry-run", "--out",
                           str(out)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["section"] for r in rows} == {"linear", "inductor", "fused"}
    for m in (1, 5):  # one cuBLAS row and exactly one picked config per M
        lin = [r for r in rows if r["section"] == "linear" and r["M"] == m]
        assert [r["variant"] for r in lin].count("cublas") == 1
        assert sum(bool(r.get("picked")) for r in lin) == 1
    assert all(r["err"] < 3e-2 for r in rows if r["err"] is not None)
    assert "| rmsnorm+tiny | 5 |" in (tmp_path / "gemm.md").read_text()


def test_sections_over_their_time_limit_are_skipped_with_a_note(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it for a dry run: restored after
    out = tmp_path / "g.json"
    assert main(["--dry-run", "--limit-scale", "0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["rows"] == [] and len(res["notes"]) == 3
    assert all("time limit" in n for n in res["notes"])


def test_report_arithmetic() -> None:
    rows = []
    for i, shape in enumerate(LAYER_GEMMS):
        base = dict(shape=shape, M=6, K=576, N=576, err=None)
        rows.append(dict(base, section="linear", variant="cublas", us=4.0))
        rows.append(dict(base, section="linear", variant="ours", us=2.0, config="a",
                         picked=True, err=1e-3))
        rows.append(dict(base, section="linear", variant="ours", us=1.0 + i, config="b",
                         picked=False, err=2e-3))
    rows.append(dict(shape="down", M=6, section="fused", variant="x unfused (inductor + cublas)",
                     us=6.0, err=0.0))
    rows.append(dict(shape="down", M=6, section="fused", variant="x fused (ours)", us=3.0,
                     err=1e-3, config="a", picked=True))
    rows.append(dict(shape="down", M=6, section="fused", variant="x fused (ours)", us=2.5,
                     err=1e-3, config="c", picked=False))
    text = markdown(dict(device="d", torch="t", rows=rows, notes=["n1"]))
    assert "| qkv | 6 | 4.00 | 2.00 | 1.00 | b | - | 2.00x | 2.0e-03 |" in text
    assert "| down | 6 | 4.00 | 2.00 | 2.00 | a | - | 2.00x | 2.0e-03 |" in text  # b slower
    assert "| x | 6 | 6.00 | 3.00 | 2.00x | 2.50 | c | 1.0e-03 |" in text  # pick, then best
    assert "| 6 | 16.00 | 8.00 |" in text and "- note: n1" in text


def test_llama8b_shapes_are_the_layer_gemms_and_lm_head() -> None:
    from kernels.bench_gemm import MODELS, parse_args

    assert parse_args(["--out", "x.json"]).model == "smollm2"
    assert parse_args(["--out", "x.json", "--model", "llama8b"]).model == "llama8b"
    assert tuple(MODELS["llama8b"]) == (*LAYER_GEMMS, "lm_head")
    assert MODELS["llama8b"]["lm_head"] == (4096, 128256)  # K, N: Llama-3.1's vocabulary
    assert MODELS["llama8b"]["gate_up"] == (4096, 2 * 14336)  # K, N of the fused projection
