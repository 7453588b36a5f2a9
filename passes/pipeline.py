"""Our torch.compile backend: run the FX passes on Dynamo's graph, then Inductor (or eager).

    backend = make_backend(hoist_fc=True)            # EAGLE-3 draft
    draft_c = torch.compile(draft_first_pass, backend=backend, fullgraph=True, dynamic=True)
    target_c = torch.compile(target, backend=make_backend(hoist_fc=False,
                             per_layer_metadata=False), fullgraph=True, dynamic=True)
    backend.stats  # {"graphs": n, "pass_matches": {"HoistEagle3Fc": 1, ...}, "per_graph": [...]}

Pass order lives in ``PASS_ORDER`` only: ``PassManager`` sorts whatever passes it is given by it
(passes of other classes run afterwards, in the order given).

Graph inputs: Dynamo calls the returned callable with the original graph's inputs (parameters
and buffers such as the KV caches included, as placeholders). Passes may remove inputs or add
new ones, so before the passes every placeholder is tagged ``InputSpec("arg", i)`` and passes tag
the placeholders they create; afterwards the final placeholders' tags form the call plan that
``PlanRunner`` follows at run time (identity plan + nothing hoisted: the compiled callable is
returned as is, zero overhead).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from passes.base import GraphPass
from passes.bind_attn_metadata import BindPerLayerAttnMetadata
from passes.graph_utils import (INPUT_SPEC_KEY, KV_WRITES, PAGED_ATTENTION, InputSpec, count_ops,
                                fresh_fake, node_val, placeholders)
from passes.hoist_fc import HOISTED_KEY, HoistEagle3Fc, HoistedPart
from passes.noop_elim import NoOpElimination
from passes.post_grad import PostGradPasses, inductor_patches
from passes.skinny_gemm import SkinnyGemmFusion
from passes.unfuse_addmm import UnfuseResidualAddmm

# THE pass order. NoOp first: stray views between cat and fc, or between a metadata input and
# the attention op, would otherwise hide those patterns. Hoisting before metadata binding keeps
# the layer pass looking at the graph that will actually be compiled. The skinny-GEMM fusion
# last: it turns linears into custom ops, which would hide the EAGLE-3 fc from the hoisting.
PASS_ORDER: list[type[GraphPass]] = [NoOpElimination, HoistEagle3Fc, BindPerLayerAttnMetadata,
                                     SkinnyGemmFusion]
# Then, inside Inductor, on the ATen graph after its own post-grad patterns (they create the
# addmm nodes this one undoes).
POST_GRAD_ORDER: list[type[GraphPass]] = [UnfuseResidualAddmm]


def default_passes(hoist_fc: bool = True, per_layer_metadata: bool = True,
                   keep_graphs: bool = False, skinny_gemm: bool = False,
                   skinny_layer: bool = False, skinny_norms: bool = False) -> list[GraphPass]:
    skip = {HoistEagle3Fc: not hoist_fc, BindPerLayerAttnMetadata: not per_layer_metadata,
            SkinnyGemmFusion: not skinny_gemm}
    options: dict[type[GraphPass], dict[str, Any]] = {
        SkinnyGemmFusion: {"layer": skinny_layer, "norms": skinny_norms}}
    return [cls(keep_graphs=keep_graphs, **options.get(cls, {})) for cls in PASS_ORDER
            if not skip.get(cls, False)]


class PassManager:
    """Runs passes in ``PASS_ORDER``; records per-pass matches; checks attention survives."""

    def __init__(self, passes: Sequence[GraphPass]) -> None:
        rank = {cls: i for i, cls in enumerate(PASS_ORDER)}
        self.passes = sorted(passes, key=lambda p: rank.get(type(p), len(rank)))  # stable

    def uuid(self) -> str:
        return hashlib.sha256("|".join(p.uuid() for p in self.passes).encode()).hexdigest()

    def __call__(self, gm: fx.GraphModule) -> tuple[dict[str, int], dict[str, Any]]:
        counts: dict[str, int] = {}
        details: dict[str, Any] = {}
        expect = (count_ops(gm, PAGED_ATTENTION), count_ops(gm, *KV_WRITES))
        for p in self.passes:
            p(gm)
            counts[p.name] = counts.get(p.name, 0) + p.match_count
            if p.details():
                details[p.name] = p.details()
            # Attention must stay one opaque custom-op node per layer, in the compiled graph:
            # a pass that drops, duplicates or hoists it would silently change the model.
            got = (count_ops(gm, PAGED_ATTENTION), count_ops(gm, *KV_WRITES))
            if got != expect:
                raise AssertionError(f"pass {p.name} changed the (paged_attention, write_kv) "
                                     f"node counts from {expect} to {got}")
        return counts, details


@dataclass
class GraphStats:
    index: int
    matches: dict[str, int]
    details: dict[str, Any]
    paged_attention_nodes: int
    inputs_before: int
    inputs_after: int
    hoisted: bool
    inductor: bool
    compile_s: float
    # Loaded from a precompiled file (compiled_spec/precompile.py) rather than compiled in this
    # process; compile_s is then the original compile's.
    precompiled: bool = False


@dataclass
class CompiledGraph:
    """What one backend call produced, for inspection (tests, debugging, the engine report)."""

    gm: fx.GraphModule  # the transformed graph handed to Inductor / run eagerly
    hoisted: HoistedPart | None
    fn: Callable[..., Any]  # what Dynamo calls: a PlanRunner, or the compiled graph itself


class PlanRunner:
    """Calls the compiled graph with inputs gathered by the plan. The hoisted part (EAGLE-3 fc)
    runs first, eagerly: a plain GraphModule call, once per call, outside ``compiled`` and thus
    outside any CUDA graph that ``wrap_compiled`` put around it."""

    def __init__(self, compiled: Callable[..., Any], plan: list[InputSpec],
                 hoisted: fx.GraphModule | None, hoisted_args: list[int],
                 backend: "CompiledSpecBackend") -> None:
        self.compiled = compiled
        self.plan = plan
        self.hoisted = hoisted
        self.hoisted_args = hoisted_args  # which of the call's inputs the hoisted part reads
        # Read at each call for its per-layer metadata; precompile (compiled_spec/
        # precompile.py) rebuilds a saved runner bound to the loading engine's backend.
        self.backend = backend

    def _resolve(self, spec: InputSpec, args: Sequence[Any], hoisted: Sequence[Any]) -> Any:
        if spec.kind == "arg":
            return args[spec.index]
        if spec.kind == "hoisted":
            return hoisted[spec.index]
        shared = self._resolve(spec.fallback, args, hoisted)  # type: ignore[arg-type]
        meta = self.backend.layer_metadata.get(spec.layer)
        if meta is None:
            return shared
        value = getattr(meta, spec.field)
        # The compiled code takes symbolic sizes from the shared input; a per-layer tensor must
        # match them or the kernel would read out of bounds.
        if value.shape != shared.shape or value.dtype != shared.dtype:
            raise ValueError(f"{spec.layer}.{spec.field}: bound {tuple(value.shape)} "
                             f"{value.dtype}, but this call's shared metadata has "
                             f"{tuple(shared.shape)} {shared.dtype}")
        return value

    def __call__(self, *args: Any) -> Any:
        hoisted = self.hoisted(*[args[i] for i in self.hoisted_args]) if self.hoisted else ()
        inputs = [self._resolve(s, args, hoisted) for s in self.plan]
        # Dynamo's calling convention (unboxed) for whatever a backend returns; don't trust a
        # `_boxed_call` attribute here: AOT's wrapper copies it from its inner function.
        return self.compiled(*inputs)


def _copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph we may rewrite: Dynamo keeps using the graph it handed us after the
    backend returns (it reads each placeholder's ``grapharg``). Node meta is copied shallowly,
    so fake values are shared, not cloned."""
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    new = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    new.meta = dict(gm.meta)
    return new


class CompiledSpecBackend:
    """The callable handed to ``torch.compile(backend=...)``; one instance may compile many
    graphs (recompiles, graph breaks) and accumulates their stats."""

    def __init__(self, passes: Sequence[GraphPass], inductor: bool = True,
                 inductor_config: dict[str, Any] | None = None,
                 wrap_compiled: Callable[[Callable[..., Any], fx.GraphModule],
                                         Callable[..., Any]] | None = None,
                 post_grad: bool = True) -> None:
        self.pass_manager = PassManager(passes)
        self.post_grad_passes = [cls() for cls in POST_GRAD_ORDER] if post_grad else []
        self.inductor = inductor
        self.inductor_config = dict(inductor_config or {})
        self.wrap_compiled = wrap_compiled
        self.graphs: list[GraphStats] = []
        self.compiled: list[CompiledGraph] = []
        self.layer_metadata: dict[str, Any] = {}  # layer name -> AttentionMetadata, see below

    # --- engine-facing ----------------------------------------------------------------------
    def bind_layer_metadata(self, metas: dict[str, Any] | None) -> None:
        """Per-layer metadata for graphs whose shared metadata BindPerLayerAttnMetadata split
        (keyed by layer name, e.g. "layers.1"); None/{} = every layer uses the shared one. Read
        at each call, so bind before calling the compiled model."""
        self.layer_metadata = dict(metas or {})

    @property
    def match_counts(self) -> dict[str, int]:
        """Total matches per pass over every graph compiled so far."""
        total: dict[str, int] = {p.name: 0 for p in
                                 [*self.pass_manager.passes, *self.post_grad_passes]}
        for g in self.graphs:
            for name, n in g.matches.items():
                total[name] = total.get(name, 0) + n
        return total

    @property
    def stats(self) -> dict[str, Any]:
        return {"graphs": len(self.graphs), "pass_matches": self.match_counts,
                "per_graph": [asdict(g) for g in self.graphs]}

    def uuid(self) -> str:
        post = "|".join(p.uuid() for p in self.post_grad_passes)
        return hashlib.sha256(f"{self.pass_manager.uuid()}|{post}".encode()).hexdigest()

    # --- compiling --------------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        gm = _copy_graph_module(gm)
        before = placeholders(gm)
        for i, ph in enumerate(before):
            ph.meta[INPUT_SPEC_KEY] = InputSpec("arg", i)
        gm.meta.pop(HOISTED_KEY, None)
        counts, details = self.pass_manager(gm)
        hoisted: HoistedPart | None = gm.meta.get(HOISTED_KEY)
        final = placeholders(gm)
        plan = []
        for ph in final:
            spec = ph.meta.get(INPUT_SPEC_KEY)
            if not isinstance(spec, InputSpec):
                raise RuntimeError(f"graph input {ph.name!r} was added by a pass without an "
                                   f"InputSpec tag ({INPUT_SPEC_KEY!r} in its meta)")
            plan.append(spec)
        if hoisted is not None and not all(isinstance(s, InputSpec) and s.kind == "arg"
                                           for s in hoisted.inputs):
            raise RuntimeError("the hoisted part may only read the original graph inputs")

        if self.inductor:
            from torch._inductor.compile_fx import compile_fx

            examples = [example_inputs[s.index] if s.kind == "arg" else fresh_fake(node_val(ph))
                        for s, ph in zip(plan, final)]
            post = PostGradPasses(self.uuid(), self.post_grad_passes)
            compiled = compile_fx(gm, examples,
                                  config_patches=inductor_patches(self.inductor_config, post))
            counts.update(post.counts)
        else:
            compiled = gm.forward
        if self.wrap_compiled is not None:
            compiled = self.wrap_compiled(compiled, gm)

        identity = [s.kind == "arg" and s.index == i for i, s in enumerate(plan)]
        self.graphs.append(GraphStats(
            index=len(self.graphs), matches=counts, details=details,
            paged_attention_nodes=count_ops(gm, PAGED_ATTENTION), inputs_before=len(before),
            inputs_after=len(final), hoisted=hoisted is not None, inductor=self.inductor,
            compile_s=round(time.perf_counter() - start, 3)))
        fn: Callable[..., Any] = compiled
        if hoisted is not None or not all(identity) or len(plan) != len(before):
            fn = PlanRunner(compiled, plan, hoisted.module if hoisted is not None else None,
                            [s.index for s in hoisted.inputs] if hoisted is not None else [],
                            self)
        self.compiled.append(CompiledGraph(gm, hoisted, fn))
        return fn


def make_backend(passes: list[GraphPass] | None = None, hoist_fc: bool = True, *,
                 per_layer_metadata: bool = True, skinny_gemm: bool = False,
                 skinny_layer: bool = False, skinny_norms: bool = False,
                 inductor: bool = True,
                 inductor_config: dict[str, Any] | None = None,
                 wrap_compiled: Callable[[Callable[..., Any], fx.GraphModule],
                                         Callable[..., Any]] | None = None,
                 keep_graphs: bool = False) -> CompiledSpecBackend:
    """A torch.compile backend running our passes, then Inductor (``inductor=False``: the
    transformed graph runs eagerly, for tests and debugging).

    passes: None = ``default_passes``; a given list is used as is (sorted by ``PASS_ORDER``),
        except that ``hoist_fc=False`` / ``per_layer_metadata=False`` drop those passes from it.
    hoist_fc: EAGLE-3 first-pass drafts; a target or EAGLE-1 graph has nothing to hoist.
    per_layer_metadata: drafts; the target shares one metadata across layers by design, so give
        it ``False`` (else each of its layers would get its own metadata inputs).
    skinny_gemm: add ``SkinnyGemmFusion`` to the default passes (residual adds folded into
        fused GEMM ops); off until measured on the GPU.
    skinny_layer: that pass also folds gate_up's SiLU-and-mul and qkv's rope + KV write;
        skinny_norms: and the RMSNorms (slower on the H200: passes/skinny_gemm.py).
    inductor_config: Inductor config patches for every compiled graph.
    wrap_compiled: ``(compiled, gm) -> callable`` around the compiled remainder only (e.g. a
        CUDA graph capture); the hoisted fc always runs outside it.
    keep_graphs: passes keep ``last_before`` / ``last_after`` graph text.
    """
    if passes is None:
        passes = default_passes(hoist_fc, per_layer_metadata, keep_graphs, skinny_gemm,
                                skinny_layer, skinny_norms)
    drop = (() if hoist_fc else (HoistEagle3Fc,)) + \
        (() if per_layer_metadata else (BindPerLayerAttnMetadata,))
    passes = [p for p in passes if not isinstance(p, drop)]
    return CompiledSpecBackend(passes, inductor=inductor, inductor_config=inductor_config,
                               wrap_compiled=wrap_compiled)
