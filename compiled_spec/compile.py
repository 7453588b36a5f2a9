"""``compile=True``: target and draft traced by torch.compile through our backend (FX passes, then
Inductor), and switched in and out of the engine so eager and compiled runs can be compared on the
same weights and KV pool.

The compiled callables, each with its own backend instance (so its pass statistics are its own):
- target forward: passes without fc hoisting or per-layer binding (one metadata for all layers);
- draft first pass (aux states -> fc -> draft): the EAGLE-3 fc is hoisted back out to eager, since
  it runs over a variable number of target tokens while the rest has per-step shapes;
- draft step (one token per request, its own hidden fed back): per-layer metadata bound; the
  chain's steps 2..k compile it together with their pick (logits, argmax / sampling, id map);
- draft trees: layer 1's top-k, each expansion (draft step, top-k, scores, next frontier) and the
  node selection, each a callable of its own, so their glue fuses.

On CUDA (``CompileConfig.cudagraphs``) the compiled callables are then captured into padded CUDA
graphs by dummy runs (``compiled_spec.engine.graphs``) and the engine replays them.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
import torch._inductor.config  # noqa: F401  (TREE_GLUE_INDUCTOR reads an option there)
import torch.fx.experimental._config  # noqa: F401  (patched per call: use_duck_shape, ...)

from capture import CapturePolicy
from compiled_spec.compile_config import CompileConfig
from compiled_spec.compile_guard import CompileGuard
from compiled_spec.engine.graphs import EngineGraphs, by_rows
from compiled_spec.engine.model_runner import ModelRunner
from compiled_spec.gemm_policy import SkinnyChoice, largest_layer_weight, resolve_skinny
from compiled_spec.own_code import own_code
from compiled_spec.pdl_policy import PdlChoice, resolve_pdl
from compiled_spec.precompile import PrecompiledModule, PrecompileStats, cache_key, precompile_dir
from kernels.dispatch import pdl_scope, skinny_wide_scope
from passes import make_backend


@dataclass
class CompiledModels:
    eager: dict[str, Any]
    compiled: dict[str, Any]
    backends: dict[str, Any] = field(default_factory=dict)
    active: bool = False
    graphs: EngineGraphs | None = None  # CUDA graphs over the compiled callables, once captured
    graphs_off: str | None = None  # why there are none (CPU device, cudagraphs=False)
    precompile: PrecompileStats | None = None  # CompileConfig.precompile: loads, saves, why not
    skinny: SkinnyChoice | None = None  # the target's skinny GEMMs as resolved (gemm_policy.py)
    skinny_draft: bool = False  # the draft's callables compiled with the target's fusions
    pdl: PdlChoice | None = None  # programmatic dependent launch as resolved (pdl_policy.py)
    pdl_draft: PdlChoice | None = None  # the same for the draft's callables (their own rows)
    # Size 1 stays symbolic (CompileConfig.size_oblivious): a one-token graph compiles nothing
    size_oblivious: bool = False
    sample_graphs: bool = True  # CompileConfig.sample_graphs
    # Graphs per compiled callable when start-up ended (None: it has not): any compiled later
    # ran inside a request, which start-up's dummy runs are there to prevent.
    startup_graphs: dict[str, int] | None = None

    def graph_counts(self) -> dict[str, int]:
        return {name: len(b.graphs) for name, b in self.backends.items()}

    def end_startup(self) -> None:
        self.startup_graphs = self.graph_counts()
        if self.graphs is not None:  # dummy requests' replays and fallbacks are no user's
            self.graphs.reset_counts()

    def compiled_after_startup(self) -> dict[str, int]:
        """Graphs each callable compiled after start-up, where any did."""
        if self.startup_graphs is None:
            return {}
        return {n: c - self.startup_graphs.get(n, 0) for n, c in self.graph_counts().items()
                if c > self.startup_graphs.get(n, 0)}

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: {"graphs": len(b.graphs), "pass_matches": b.match_counts}
                               for name, b in self.backends.items()}
        late = self.compiled_after_startup()
        if late:
            out["compiled_after_startup"] = late
        if self.skinny is not None:
            out["skinny_gemm"] = {**asdict(self.skinny), "draft": self.skinny_draft}
        if self.pdl is not None:
            out["pdl"] = asdict(self.pdl)
        if self.pdl_draft is not None:
            out["pdl_draft"] = asdict(self.pdl_draft)
        out["cuda_graphs"] = self.graphs.stats() if self.graphs is not None else {
            "off": self.graphs_off or "not captured"}
        # callables run eagerly for shapes they failed to compile for (none: left out)
        failed = {name: c.guard.stats() for name, c in self.compiled.items()
                  if getattr(c, "guard", None) is not None and c.guard.failures}
        if failed:
            out["compile_failures"] = failed
        return out


def compile_callable(fn: Any, backend: Any, cfg: CompileConfig,
                     precompile: tuple[str, PrecompileStats, dict[str, Any]] | None = None) -> Any:
    """``precompile``: (name, stats, cache-key parts) to serve ``fn`` (an nn.Module or a
    module's bound method) from precompiled entries (compiled_spec/precompile.py), falling back
    to the traced callable."""
    fn = own_code(fn)  # a method shared by every instance: this engine's own Dynamo cache
    compiled = torch.compile(fn, backend=backend, dynamic=cfg.dynamic, fullgraph=True)
    run: Any = compiled
    if precompile is not None:
        name, stats, parts = precompile
        module, method = (fn, "forward") if isinstance(fn, torch.nn.Module) else (
            fn.__self__, fn.__name__)
        key = cache_key(name, module, backend.uuid(), {**parts, "method": method})
        run = PrecompiledModule(name, module, backend, cfg.dynamic, compiled,
                                precompile_dir() / f"{name}-{key}.bin", stats, method)

    # A shape whose compile failed runs eagerly from then on, counted (compile_guard.py).
    guard = CompileGuard(getattr(fn, "__qualname__", type(fn).__name__), fn)

    def call(*args: Any, **kwargs: Any) -> Any:
        # No duck sizing while Dynamo traces our calls: it would tie dims that merely happen to
        # be equal in the first call (a 2-entry query_start_loc and a 2-block table at batch 1)
        # and recompile, seconds mid-serving, the first time they differ. Scoped to our calls
        # (a CUDA-graph replay does not come through here), not set process-wide.
        # Python floats (RMSNorm eps, the embedding's norm_type) are specialized from the start:
        # with dynamic=True Dynamo otherwise traces them as symbols, and its scalar-tensorify
        # pass then restarts the whole analysis to specialize them, so every target compile
        # traced the model and ran AOTAutograd twice (the first attempt's AOT cache entry never
        # hits: ~8.5 s of a 22 s warm start on the CPU, ninth session).
        # cfg.pdl: our kernels launched from this call (or captured from it) on PDL too;
        # cfg.skinny_gemm_wide: the skinny-GEMM ops take up to 256 rows there.
        with torch.fx.experimental._config.patch(use_duck_shape=False,
                                                 backed_size_oblivious=cfg.size_oblivious), \
                torch._dynamo.config.patch(specialize_float=True), pdl_scope(cfg.pdl), \
                skinny_wide_scope(cfg.skinny_gemm_wide):
            return guard(run, *args, **kwargs)

    call.__wrapped__ = compiled  # type: ignore[attr-defined]
    call.guard = guard  # type: ignore[attr-defined]
    return call


def inductor_config(cfg: CompileConfig) -> dict[str, Any]:
    """The Inductor config patches every compiled callable of an engine gets."""
    patches: dict[str, Any] = {}
    if cfg.autotune_gemm:
        # ATEN (cuBLAS) stays a candidate, so a template is chosen only where it measured
        # faster; on a machine without Triton GEMMs (the CPU) nothing changes.
        patches.update(max_autotune_gemm=True, max_autotune_gemm_backends="ATEN,TRITON")
    if cfg.pdl:  # Inductor emits it only for devices that support it (none on the CPU)
        patches["triton.enable_pdl"] = True
    return patches


# Inductor patches for the draft tree's glue graphs only (tree_head, tree_step, tree_finish,
# tree_early_stage). Inductor's coalesce-tiling analysis asserts with an empty message on some
# fused pointwise + reduction kernels of symbolic size (tiling_utils.get_pw_red_splits; its own
# config says the analysis "does not yet apply to dynamic shapes", yet it runs on them; a public
# report names torch 2.11 on CUDA). The sixteenth session's H200 run failed exactly so, an empty
# Inductor AssertionError, capturing the tree graphs at batch 4 and 16, where the batch is a
# symbol; at batch 1 it is specialised and they capture. The tree glue's node ranking reduces
# [B, C, C] comparisons into [B, C] and [B, n] values: pointwise and reduction nodes of several
# sizes in one graph. Suspected, not yet confirmed on the GPU: profiles/scripts/
# tree_capture_h200.py runs the batch-4 engine with and without this patch.
TREE_GLUE_INDUCTOR: dict[str, Any] = (
    {"triton.coalesce_tiling_analysis": False}
    if hasattr(torch._inductor.config.triton, "coalesce_tiling_analysis") else {})


def precompile_on(cfg: CompileConfig, model: torch.nn.Module) -> bool:
    """``cfg.precompile``, with None resolved by where the model's weights live."""
    if cfg.precompile is not None:
        return cfg.precompile
    param = next(model.parameters(), None)
    return param is not None and param.device.type == "cuda"


def compile_models(runner: ModelRunner, cfg: CompileConfig,
                   max_decode_rows: int | None = None,
                   max_draft_rows: int | None = None) -> CompiledModels:
    """The engine's compiled callables (compiled on first use). ``max_decode_rows``: its widest
    decode call (max_num_seqs x rows per request), which the PDL default reads;
    ``max_draft_rows``: the draft's (None: the same)."""
    # Dynamo's recompile limit counts per code object, and every engine's modules run the same
    # forward code: the default 8 would make the 9th engine in a process fail (fullgraph=True).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    skinny = resolve_skinny(cfg.skinny_gemm, cfg.skinny_gemm_layer, runner.model,
                            cfg.skinny_gemm_readout)
    if hasattr(runner.model, "skinny_readout"):  # eager and captured logits alike
        runner.model.skinny_readout = skinny.readout
    asked_pdl = cfg.pdl
    pdl = resolve_pdl(asked_pdl, runner.device, skinny.layer, max_decode_rows, cfg.pdl_narrow,
                      largest_layer_weight(runner.model))
    # Resolved: Inductor's config, our launches, cache keys. With PDL for narrow calls only,
    # the target compiled without it serves the wide ones, a second compile (``narrow_cfg``)
    # the rest (EngineGraphs picks by rows).
    cfg = replace(cfg, pdl=pdl.on and pdl.max_rows is None, pdl_narrow=False)
    narrow_cfg = replace(cfg, pdl=True) if pdl.on and pdl.max_rows is not None else None
    backend = functools.partial(make_backend, inductor=cfg.inductor,
                                inductor_config=inductor_config(cfg))
    eager: dict[str, Any] = {"target": runner.target_fn}
    fusions = {"skinny_gemm": skinny.gemm, "skinny_layer": skinny.layer,
               "skinny_norms": cfg.skinny_gemm_norms}
    backends = {"target": backend(hoist_fc=False, per_layer_metadata=False, **fusions)}
    if narrow_cfg is not None:  # the same backend but for Inductor's PDL option
        backends["target_pdl"] = backend(hoist_fc=False, per_layer_metadata=False, **fusions,
                                         inductor_config=inductor_config(narrow_cfg))
    prop = runner.proposer
    # The draft's callables take the target's fusions unless told not to (nothing to fuse when
    # the target's resolved off: fp32, the CPU without skinny_gemm=True).
    draft_skinny = cfg.skinny_gemm_draft is not False and skinny.gemm and prop is not None
    dk: dict[str, Any] = fusions if draft_skinny else {}
    # The draft decides PDL by its own widest call: a tree verifies num_draft_tokens rows per
    # request but drafts at most num_steps + 1 (a chain: k + 1 both), so a tree engine of a
    # few requests keeps PDL on its draft while its wide verify goes without.
    draft_pdl = resolve_pdl(asked_pdl, runner.device, skinny.layer and draft_skinny,
                            max_decode_rows if max_draft_rows is None else max_draft_rows,
                            largest_weight=0 if prop is None else
                            largest_layer_weight(prop.draft))
    dcfg = replace(cfg, pdl=draft_pdl.on)
    dbackend = functools.partial(make_backend, inductor=cfg.inductor,
                                 inductor_config=inductor_config(dcfg))
    stats = PrecompileStats() if precompile_on(cfg, runner.model) else None
    parts: dict[str, Any] = {}
    if stats is not None:
        # Everything outside the module that shapes its graph (the module's own config, dtype
        # and device are read from it); k changes the verify's token counts (dynamic anyway).
        parts = {"k": getattr(prop, "k", 0), **asdict(cfg), "pdl_draft": dcfg.pdl,
                 "pdl_max_rows": pdl.max_rows,
                 "skinny_gemm": skinny.gemm, "skinny_gemm_layer": skinny.layer}
        parts.pop("cache_dir")  # where the file lives, not what it holds
        parts.pop("precompile")  # None (the CUDA default) and True save the same artifacts
        if prop is not None:  # the draft callables' modules: the draft's config, the pick's
            parts.update(draft=repr(prop.draft.config), tree=repr(getattr(prop, "cfg", None)),
                         sample_drafts=getattr(prop, "sample_drafts", None),
                         target_vocab=getattr(prop, "target_vocab_size", None))

    def pre(name: str) -> tuple[str, PrecompileStats, dict[str, Any]] | None:
        return None if stats is None else (name, stats, parts)

    compiled: dict[str, Any] = {"target": compile_callable(runner.model, backends["target"], cfg,
                                                           pre("target"))}
    if narrow_cfg is not None:
        compiled["target_pdl"] = compile_callable(runner.model, backends["target_pdl"],
                                                  narrow_cfg, pre("target_pdl"))
    if prop is not None:
        eager.update(first_pass=prop.first_pass_fn, step=prop.step_fn)
        backends["draft_first_pass"] = dbackend(hoist_fc=True, **dk)
        backends["draft_step"] = dbackend(hoist_fc=False, **dk)
        compiled["first_pass"] = compile_callable(prop.draft.forward_from_aux,
                                                  backends["draft_first_pass"], dcfg,
                                                  pre("first_pass"))
        compiled["step"] = compile_callable(prop.draft, backends["draft_step"], dcfg, pre("step"))
        if hasattr(prop, "glue"):  # draft trees: each expansion and its glue as one graph
            glue = functools.partial(dbackend, hoist_fc=False, **dk,
                                     inductor_config=inductor_config(dcfg) | TREE_GLUE_INDUCTOR)
            # (an early tree step's staging between verify and draft: compiled on first use)
            for name, fn in (("tree_head", prop.glue.head), ("tree_step", prop.glue.expand_step),
                             ("tree_finish", prop.glue.finish),
                             ("tree_early_stage", prop.early_stage)):
                backends[name] = glue()
                compiled[name] = compile_callable(fn, backends[name], dcfg, pre(name))
            eager.update(tree_head=prop.head_fn, tree_step=prop.expand_step_fn,
                         tree_finish=prop.finish_fn, tree_early_stage=prop.early_stage_fn)
        if hasattr(prop, "picker"):  # chain drafting: step + pick as one graph
            eager["step_pick"] = prop.step_pick_fn
            backends["draft_step_pick"] = dbackend(hoist_fc=False, **dk)
            compiled["step_pick"] = compile_callable(prop.picker, backends["draft_step_pick"],
                                                     dcfg, pre("step_pick"))
            # an early step's pick + loop metadata (compiled on first use)
            eager["pick_plan"] = prop.pick_plan_fn
            backends["draft_pick_plan"] = dbackend(hoist_fc=False, **dk)
            compiled["pick_plan"] = compile_callable(prop.picker.pick_and_plan,
                                                     backends["draft_pick_plan"], dcfg,
                                                     pre("pick_plan"))
    if cfg.sample_graphs and cfg.sample_compile:  # the draws the sample graphs capture
        from compiled_spec.engine.sample_graph import draw_tokens

        eager["sample_draw"] = draw_tokens
        backends["sample_draw"] = backend(hoist_fc=False, per_layer_metadata=False)
        compiled["sample_draw"] = compile_callable(draw_tokens, backends["sample_draw"], cfg)
    return CompiledModels(eager=eager, compiled=compiled, backends=backends, precompile=stats,
                          skinny=skinny, skinny_draft=draft_skinny, pdl=pdl,
                          pdl_draft=draft_pdl if prop is not None else None,
                          size_oblivious=cfg.size_oblivious, sample_graphs=cfg.sample_graphs)


def capture_graphs(runner: ModelRunner, models: CompiledModels, policy: CapturePolicy,
                   page_size: int, strict: bool = False, emulate: bool = False) -> EngineGraphs:
    """Capture the compiled callables by dummy runs (call with the compiled ones active) and
    route the engine through the graphs from now on while compiled mode is on. ``emulate``:
    CPU stand-ins for CUDA graphs (tests)."""
    use_compiled(runner, models, True)
    # (runner.target_fn: the compiled target, or the two picked by rows, see use_compiled)
    # An engine that may pause drafting decodes one token per request at batch 1 too: a graph
    # of its own where that costs no compile, not the 1 + k-row verify graph padded
    pauses = getattr(runner.proposer, "capture_sync", False)  # (tree proposers never pause)
    graphs = EngineGraphs(runner, runner.target_fn, policy, page_size, strict, emulate,
                          single_decode=pauses and models.size_oblivious,
                          sample_graphs=models.sample_graphs)
    if graphs.sample is not None and "sample_draw" in models.compiled:
        graphs.sample.draw_fn = models.compiled["sample_draw"]
    graphs.capture()
    models.graphs = graphs
    _route(runner, models, True)
    if getattr(runner, "tree", None) is not None:  # a not_all_tree step's kernels, loaded now
        from compiled_spec.engine.tree_verify import warm_mixed_verify
        warm_mixed_verify(runner)
    return graphs


def use_compiled(runner: ModelRunner, models: CompiledModels, on: bool) -> None:
    """Route the engine through the compiled (on) or eager (off) callables."""
    fns = models.compiled if on else models.eager
    runner.target_fn = fns["target"]
    if on and "target_pdl" in fns:  # (compiled only where pdl.max_rows is set)
        runner.target_fn = by_rows(fns["target"], fns["target_pdl"], models.pdl.max_rows)
    if runner.proposer is not None:
        runner.proposer.first_pass_fn = fns["first_pass"]
        runner.proposer.step_fn = fns["step"]
        if "step_pick" in fns:
            runner.proposer.step_pick_fn = fns["step_pick"]
            runner.proposer.pick_plan_fn = fns["pick_plan"]
        if "tree_step" in fns:
            prop = runner.proposer
            prop.head_fn, prop.expand_step_fn, prop.finish_fn = (
                fns["tree_head"], fns["tree_step"], fns["tree_finish"])
            prop.early_stage_fn = fns["tree_early_stage"]
    _route(runner, models, on)
    models.active = on


def _route(runner: ModelRunner, models: CompiledModels, on: bool) -> None:
    g = models.graphs if on else None
    if runner.proposer is not None:
        runner.proposer.graph = None if g is None else g.propose
        runner.proposer.early_graph = None if g is None else g.propose_early
        runner.proposer.sync_graph = None if g is None else g.sync
        # (a tree proposer's prompts go through the chain proposer it wraps)
        getattr(runner.proposer, "base", runner.proposer).prefill_graph = (
            None if g is None else g.draft_prefill)
    runner.sample_graph = None if g is None else g.sample
    if g is not None:
        runner.target_fn = g.target
