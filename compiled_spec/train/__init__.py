"""EAGLE-3 draft-head training: self-distillation data, draft vocabulary, training-time test.

Exports are resolved lazily so ``compiled_spec.train.cli`` (imported by the CLI at start-up) does
not pull in torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["TrainConfig", "train"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from compiled_spec.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'compiled_spec.train' has no attribute {name!r}")
