"""``compile=True``: target and draft traced by torch.compile through our backend (FX passes, then
Inductor), and switched in and out of the engine so eager and compiled runs can be compared on the
same weights and KV pool.

Three compiled callables, each with its own backend instance (so its pass statistics are its own):
- target forward: passes without fc hoisting or per-layer binding (one metadata for all layers);
- draft first pass (aux states -> fc -> draft): the EAGLE-3 fc is hoisted back out to eager, since
  it runs over a variable number of target tokens while the rest has per-step shapes;
- draft step (one token per request, its own hidden fed back): per-layer metadata bound.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from compiled_spec.engine.model_runner import ModelRunner
from passes import make_backend


@dataclass
class CompileConfig:
    inductor: bool = True  # False: run our transformed graphs eagerly (debugging)
    dynamic: bool = True  # token counts vary per step; avoid one recompile per batch shape

    def __post_init__(self) -> None:
        if not isinstance(self.inductor, bool) or not isinstance(self.dynamic, bool):
            raise ValueError("CompileConfig.inductor and .dynamic must be booleans")


@dataclass
class CompiledModels:
    eager: dict[str, Any]
    compiled: dict[str, Any]
    backends: dict[str, Any] = field(default_factory=dict)
    active: bool = False

    def stats(self) -> dict[str, Any]:
        return {name: {"graphs": len(b.graphs), "pass_matches": b.match_counts}
                for name, b in self.backends.items()}


def _compile(fn: Any, backend: Any, cfg: CompileConfig) -> Any:
    return torch.compile(fn, backend=backend, dynamic=cfg.dynamic, fullgraph=True)


def compile_models(runner: ModelRunner, cfg: CompileConfig) -> CompiledModels:
    eager: dict[str, Any] = {"target": runner.target_fn}
    backends = {"target": make_backend(hoist_fc=False, per_layer_metadata=False, inductor=cfg.inductor)}
    compiled: dict[str, Any] = {"target": _compile(runner.model, backends["target"], cfg)}
    prop = runner.proposer
    if prop is not None:
        eager.update(first_pass=prop.first_pass_fn, step=prop.step_fn)
        backends["draft_first_pass"] = make_backend(hoist_fc=True, inductor=cfg.inductor)
        backends["draft_step"] = make_backend(hoist_fc=False, inductor=cfg.inductor)
        compiled["first_pass"] = _compile(prop.draft.forward_from_aux, backends["draft_first_pass"], cfg)
        compiled["step"] = _compile(prop.draft, backends["draft_step"], cfg)
    return CompiledModels(eager=eager, compiled=compiled, backends=backends)


def use_compiled(runner: ModelRunner, models: CompiledModels, on: bool) -> None:
    """Route the engine through the compiled (on) or eager (off) callables."""
    fns = models.compiled if on else models.eager
    runner.target_fn = fns["target"]
    if runner.proposer is not None:
        runner.proposer.first_pass_fn = fns["first_pass"]
        runner.proposer.step_fn = fns["step"]
    models.active = on
