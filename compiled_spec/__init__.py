"""compiled_spec: a compiler-driven speculative-decoding engine for EAGLE draft heads."""
from __future__ import annotations

from typing import TYPE_CHECKING

from compiled_spec.sampling_params import SamplingParams

if TYPE_CHECKING:
    from compiled_spec.llm import LLM

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in transformers and the model code; import it on first use so that light
    # submodules (sampling, kv cache, kernels) import fast.
    if name == "LLM":
        from compiled_spec.llm import LLM

        return LLM
    raise AttributeError(f"module 'compiled_spec' has no attribute {name!r}")
