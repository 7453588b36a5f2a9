"""``LLM``'s compile switch and what it reports: torch.compile of the target and draft, CUDA-graph
capture of every size by dummy runs, the start-up seconds both take, and the compile cache's and
passes' statistics.

A mixin, not a helper object: the state stays on the LLM, where tests set ``llm._compiled``
directly and a capture that raises leaves the compiled models behind.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from capture import CapturePolicy, mixed_sizes, prefill_sizes
from compiled_spec.compile import CompileConfig, CompiledModels, capture_graphs, compile_models, \
    use_compiled
from compiled_spec.compile_cache import CacheStats, activate as activate_compile_cache
from compiled_spec.config import EngineConfig
from compiled_spec.engine.warm_paths import warm_uncaptured_paths
from compiled_spec.gc_heap import freeze_startup_heap
from kernels.warmup import warm_model_attention
from kernels.warmup_parallel import pdl_warmup_enabled

if TYPE_CHECKING:
    from compiled_spec.engine.engine import LLMEngine


def engine_capture_policy(cc: CompileConfig, ec: EngineConfig) -> CapturePolicy:
    """What an engine captures: its batch sizes and buckets, one-sequence prompt steps up to
    prefill_graph_tokens, and prompt steps of several sequences up to mixed_graph_tokens (at
    most a full token budget of prompts beside max_num_seqs verifying requests, and at most
    what max_num_seqs prompts hold), each of their prompts at most the largest one-sequence
    graph's length (or 512 tokens without those)."""
    k = 0 if ec.spec is None else ec.spec.num_speculative_tokens
    sched = ec.scheduler
    pre = prefill_sizes(min(cc.prefill_graph_tokens, ec.max_model_len,
                            sched.max_num_batched_tokens), 1 + k)
    q_cap = min(pre[-1] if pre else 512, ec.max_model_len)
    # A mixed step holds at most max_num_seqs prompts of q_cap tokens: larger sizes could never
    # replay, and their dummy batches failed capture (H100, batch 4: 4096 and 4120 > 4 x 512).
    mixed = mixed_sizes(min(cc.mixed_graph_tokens,
                            sched.max_num_batched_tokens + sched.max_num_seqs * (1 + k),
                            sched.max_num_seqs * q_cap))
    mixed_q = min(q_cap, mixed[-1]) if mixed else 0
    return CapturePolicy(max_batch_size=sched.max_num_seqs, num_speculative_tokens=k,
                         max_model_len=ec.max_model_len, batch_sizes=cc.capture_batch_sizes,
                         seq_len_buckets=cc.seq_len_buckets, prefill_sizes=pre,
                         mixed_sizes=mixed, mixed_query_len=mixed_q,
                         verify_widths=() if ec.spec is None else ec.spec.adaptive_k)


def max_decode_rows(ec: EngineConfig) -> int:
    """The widest decode call an engine makes: every running request verifying its whole
    proposal (1 + k rows per request for a chain, the tree's node budget for a tree)."""
    spec = ec.spec
    per = (1 if spec is None else
           spec.tree.num_draft_tokens if spec.tree is not None else 1 + spec.num_speculative_tokens)
    return ec.scheduler.max_num_seqs * per


def max_draft_rows(ec: EngineConfig) -> int | None:
    """The draft's widest decode call: its first pass over every running request's accepted
    tokens and bonus (1 + k rows for a chain, 1 + num_steps for a tree; a tree's expansions are
    topk rows). None without a draft."""
    spec = ec.spec
    if spec is None:
        return None
    tree = spec.tree
    per = 1 + spec.num_speculative_tokens if tree is None else max(1 + tree.num_steps, tree.topk)
    return ec.scheduler.max_num_seqs * per


def warm_pdl_attention(engine: "LLMEngine", models: CompiledModels, max_model_len: int
                       ) -> dict[str, float | int] | None:
    """The attention binaries that the engine's PDL launches use (GDC=1), compiled now for the
    target's layers and the draft's where their calls launch with PDL (``models.pdl`` /
    ``pdl_draft`` as resolved), with ``COMPILED_SPEC_PDL_WARMUP=1``; None where nothing is.
    The engine's own warm-up (``LLMEngine.kernel_warmup``) ran before PDL was resolved and
    compiled GDC=0 binaries only, so the captures compiled these, serially."""
    if not pdl_warmup_enabled():
        return None
    layers = engine.attention_layers(target=models.pdl is not None and models.pdl.on,
                                     draft=models.pdl_draft is not None and models.pdl_draft.on)
    if not layers:
        return None
    return warm_model_attention(layers, max_model_len, max_model_len, gdc=True)


class CompileMixin:
    """The compilation half of ``LLM``; ``LLM.__init__`` sets the attributes below (a
    tensor-parallel launcher sets only ``config``: its workers compile)."""

    config: EngineConfig
    engine: LLMEngine
    startup_s: dict[str, float]
    # Wall seconds inside compile + capture, by step: "compile_models" (wrapping the callables,
    # loading precompiled artifacts), "capture <component>" (its dummy runs, the compiles they
    # meet, the captures) and "capture rest"; the compile time of startup_s is spread over them.
    startup_detail_s: dict[str, float]
    _compile_config: CompileConfig
    _compiled: CompiledModels | None
    _cache_stats: CacheStats | None

    def set_compiled(self, on: bool) -> None:
        """Run through the torch.compile'd target and draft (compiled on first use) or eager."""
        if on and self._compiled is None:
            t0 = time.perf_counter()
            cc, ec = self._compile_config, self.config
            self._cache_stats = CacheStats.begin(activate_compile_cache(cc.cache_dir))
            self._compiled = compile_models(self.engine.runner, cc, max_decode_rows(ec),
                                            max_draft_rows(ec))
            pdl_warm = warm_pdl_attention(self.engine, self._compiled, ec.max_model_len)
            if pdl_warm is not None:  # (within "compile_models" below too)
                self.startup_detail_s["attention_warmup_pdl"] = float(pdl_warm["seconds"])
            t_models = time.perf_counter()
            self.startup_detail_s["compile_models"] = t_models - t0  # precompile loads
            if not cc.cudagraphs or ec.device.type != "cuda":
                self._compiled.graphs_off = ("cudagraphs=False" if not cc.cudagraphs else
                                             f"device {ec.device} has no CUDA graphs")
            else:  # compiles (dynamic shapes) and captures every size by dummy runs
                graphs = capture_graphs(self.engine.runner, self._compiled,
                                        engine_capture_policy(cc, ec), ec.cache.page_size,
                                        cc.strict_capture)
                per = {f"capture {n}": s for n, s in graphs.registry.capture_s.items()}
                self.startup_detail_s.update(per)
                self.startup_detail_s["capture rest"] = (
                    time.perf_counter() - t_models - sum(per.values()))
            compile_s = sum(g.compile_s for b in self._compiled.backends.values()
                            for g in b.graphs if not g.precompiled)  # loaded: not this process's
            self.startup_s["compile"] = compile_s
            self.startup_s["capture"] = time.perf_counter() - t0 - compile_s
            if self._compiled.graphs is not None:
                # Prompt steps run the compiled callables outside the graphs, with shapes no
                # capture met: compiled now by dummy requests, not inside the first user's.
                self.startup_s["warm_paths"] = warm_uncaptured_paths(self.engine)
                self._compiled.end_startup()
            if ec.gc_freeze:  # compiling made most of the long-lived heap: see gc_heap.py
                self.startup_s["gc_freeze"] = freeze_startup_heap()
        if self._compiled is not None:
            use_compiled(self.engine.runner, self._compiled, on)

    @property
    def compiled_active(self) -> bool:
        return self._compiled is not None and self._compiled.active

    @property
    def compile_cache(self) -> dict:
        """The compile cache in use and its hits / misses (FX graphs, AOTAutograd graphs) since
        this LLM started compiling; {} before compile=True."""
        if self._cache_stats is None:
            return {}
        out = self._cache_stats.as_dict()
        if self._compiled is not None and self._compiled.precompile is not None:
            out["precompile"] = self._compiled.precompile.as_dict()
        return out

    @property
    def compile_stats(self) -> dict:
        """Per compiled callable: graphs compiled and how often each FX pass matched."""
        return {} if self._compiled is None else self._compiled.stats()
