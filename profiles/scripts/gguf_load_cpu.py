"""SmolLM2 GGUF load time (fp32, CPU) in a fresh process; run it twice with one
COMPILED_SPEC_CACHE: the first parses the header and caches it, the second reads the cache
(compiled_spec/models/gguf_index.py).

python profiles/scripts/gguf_load_cpu.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from compiled_spec.models.gguf_loader import find_default_gguf, load_gguf  # noqa: E402

if __name__ == "__main__":
    path = find_default_gguf()
    t0 = time.perf_counter()
    load_gguf(path, torch.float32)
    print(round(time.perf_counter() - t0, 2))
