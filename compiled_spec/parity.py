"""Built-in eager-versus-compiled parity: compiling must never change acceptance.

The same prompts run through the same engine (same weights, same KV pool) once with the eager
callables and once with the compiled ones. The check fails when greedy fp32 outputs differ, or
when mean acceptance length moves by more than a tolerance: the signature of a draft whose
compiled graph was never captured or whose fc was fed the wrong inputs. Where the outputs
themselves part (bf16 rounds differently in fused kernels), the two runs draft over different
text and their taus differ by chance in either direction (the thirty-eighth session's H100
tree: 2.784 eager, 2.933 compiled); only a drop is then the bug class, so only a drop fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compiled_spec.sampling_params import SamplingParams
from compiled_spec.spec.metrics import SpecStats


@dataclass
class ParityRun:
    mode: str  # "eager" | "compiled"
    tau: float | None
    per_position: list[float] | None
    token_ids: list[list[int]]


@dataclass
class ParityReport:
    eager: ParityRun
    compiled: ParityRun
    tau_tolerance: float
    require_identical: bool
    first_divergence: list[int | None] = field(default_factory=list)  # per prompt, token index
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        def fmt(r: ParityRun) -> str:
            tau = "n/a" if r.tau is None else f"{r.tau:.3f}"
            pos = " ".join(f"{x:.2f}" for x in r.per_position or [])
            return f"{r.mode:9s} tau {tau}  per-position acceptance [{pos}]"

        lines = [fmt(self.eager), fmt(self.compiled)]
        div = [f"prompt {i}: token {d}" for i, d in enumerate(self.first_divergence) if d is not None]
        lines.append("first diverging tokens: " + (", ".join(div) if div else "none"))
        lines += [f"note: {n}" for n in self.notes]
        lines.append("PASS" if self.ok else "FAIL: " + "; ".join(self.failures))
        return "\n".join(lines)

    def raise_for_failure(self) -> None:
        if not self.ok:
            raise AssertionError(f"eager vs compiled parity failed:\n{self}")


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _run(llm, prompts: list[list[int]], params: SamplingParams, compiled: bool) -> ParityRun:
    engine = llm.engine
    llm.set_compiled(compiled)
    saved, engine.stats.spec = engine.stats.spec, SpecStats()
    # An adaptive policy pauses by measured step cost, which compiling changes: both runs draft
    # every step at full k, so their acceptance compares (the policy and its state come back).
    policy, engine.stats.policy = engine.stats.policy, None
    early = engine.runner.early
    paused, verify_k = (early.paused if early is not None else False), engine.runner.verify_k
    if early is not None:
        early.paused = False
    engine.runner.verify_k = engine.runner.k
    try:
        outs = llm.generate(prompts, params)
        run = engine.stats.spec
    finally:
        engine.stats.spec = saved.merge(engine.stats.spec)
        engine.stats.policy, engine.runner.verify_k = policy, verify_k
        if early is not None:
            early.paused = paused
    return ParityRun(mode="compiled" if compiled else "eager", tau=run.mean_acceptance_length,
                     per_position=run.acceptance_rate_per_position,
                     token_ids=[o.token_ids for o in outs])


def check_parity(llm, prompts: list[list[int]], params: SamplingParams | None = None,
                 tau_tolerance: float = 0.05) -> ParityReport:
    params = params or SamplingParams(max_tokens=64, temperature=0.0)
    was = llm.compiled_active
    try:
        eager = _run(llm, prompts, params, compiled=False)
        comp = _run(llm, prompts, params, compiled=True)
    finally:
        llm.set_compiled(was)
    require_identical = params.greedy and llm.config.dtype == torch.float32
    rep = ParityReport(eager=eager, compiled=comp, tau_tolerance=tau_tolerance,
                       require_identical=require_identical,
                       first_divergence=[_first_divergence(a, b)
                                         for a, b in zip(eager.token_ids, comp.token_ids)])
    judge(rep, speculative=llm.config.spec is not None)
    return rep


def judge(rep: ParityReport, speculative: bool) -> None:
    """Fill rep.failures (and rep.notes) from the two runs."""
    n_div = sum(d is not None for d in rep.first_divergence)
    if speculative:
        eager, comp, tol = rep.eager.tau, rep.compiled.tau, rep.tau_tolerance
        if eager is None or comp is None:
            rep.failures.append(f"no drafting step ran (eager tau {eager}, compiled tau {comp})")
        elif comp < eager - tol or (n_div == 0 and comp > eager + tol):
            rep.failures.append(f"tau {eager:.3f} eager vs {comp:.3f} compiled differs by "
                                f"more than {tol}")
        elif comp > eager + tol:
            rep.notes.append(f"compiled tau {comp:.3f} above eager's {eager:.3f}, over text that "
                             f"parted on {n_div} of {len(rep.first_divergence)} prompts "
                             f"(not the bug class: only a drop fails)")
    if rep.require_identical and n_div:
        rep.failures.append(f"greedy fp32 outputs differ on {n_div} of "
                            f"{len(rep.first_divergence)} prompts")
