"""The evaluation prompts ship with the package: no default path, test or README command needs
../shared beside the repository, and the training refusal still fires on the shipped file."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from compiled_spec.data import mt_bench_path

ROOT = Path(__file__).resolve().parents[1]


def test_mt_bench_ships_with_the_package():
    p = mt_bench_path()
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    assert len(rows) == 80 and all(len(r["turns"]) == 2 for r in rows)
    assert ROOT in p.parents  # the package's own copy, not ../shared


def test_package_data_is_declared():
    tomllib = pytest.importorskip("tomllib")
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = cfg["tool"]["setuptools"]["package-data"]["compiled_spec.data"]
    assert any(mt_bench_path().match(g) for g in globs)


def test_cli_default_prompts_is_the_shipped_file():
    from compiled_spec.bench import load_mt_bench
    from compiled_spec.cli import _add_prompt_args
    import argparse

    p = argparse.ArgumentParser()
    _add_prompt_args(p, num_prompts=3, max_tokens=8)
    a = p.parse_args([])
    assert Path(a.prompts) == mt_bench_path()
    assert len(load_mt_bench(a.prompts, a.num_prompts)) == 3


def test_training_refuses_the_shipped_eval_set():
    from compiled_spec.train.data import load_prompts

    with pytest.raises(ValueError, match="never train on it"):
        load_prompts(mt_bench_path())


def test_nothing_outside_profiles_reads_shared():
    """../shared is absent on a fresh machine; only profiles/ (recorded measurements) may cite it."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    if not files:  # not a git checkout (an sdist, say): nothing to scan
        pytest.skip("not a git checkout")
    bad = [f for f in files if not f.startswith("profiles/") and f != "tests/test_shipped_data.py"
           and (ROOT / f).is_file() and f.endswith((".py", ".md", ".toml", "Makefile", "run"))
           and "../shared" in (ROOT / f).read_text(errors="ignore")]
    assert bad == []
