"""Every ``profiles/...`` path that the READMEs, the measurement history and the measurement
scripts name exists, so moving a script or a result folder cannot leave a stale pointer behind.
(Result files themselves, logs and raw outputs, are records of their run and are not checked.)"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Paths a command writes, not files in the repository.
_OUTPUTS = ("profiles/traces", "profiles/cpu_bench")
_PATH = re.compile(r"profiles/[\w./-]*[\w/]")


def _documents() -> list[Path]:
    docs = [ROOT / "README.md", ROOT / "Makefile", *(ROOT / "profiles").glob("*.md"),
            *(ROOT / "profiles" / "results").glob("*.md"),
            *(ROOT / "profiles" / "results").glob("*/README.md"),
            *(ROOT / "profiles" / "scripts").iterdir()]
    return sorted(d for d in docs if d.is_file())


def test_named_profiles_paths_exist():
    missing = []
    for doc in _documents():
        for m in _PATH.finditer(doc.read_text()):
            path = m.group(0).rstrip(".")
            if path.startswith(_OUTPUTS) or "*" in doc.read_text()[m.end():m.end() + 1]:
                continue
            if not (ROOT / path).exists():
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, "paths named but not in the repository:\n" + "\n".join(missing)
