"""Running a test module's Triton worker under ``TRITON_INTERPRET=1``: the interpreter must be
chosen before triton is imported, so the worker is a subprocess of its own. The worker prints
one ``RESULTS {json}`` line; this returns that JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(module_file: str, flag: str = "--worker", timeout: int = 600) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO_ROOT))
    proc = subprocess.run([sys.executable, module_file, flag], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])
