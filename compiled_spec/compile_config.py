"""``CompileConfig``: what ``compile=True`` compiles and captures, and how (validated on
construction; ``compiled_spec.compile`` applies it)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch._inductor.config  # noqa: F401  (CompileConfig.pdl checks an option there)


@dataclass
class CompileConfig:
    inductor: bool = True  # False: run our transformed graphs eagerly (debugging)
    dynamic: bool = True  # token counts vary per step; avoid one recompile per batch shape
    cudagraphs: bool = True  # on CUDA: capture padded graphs at start-up and replay them
    capture_batch_sizes: tuple[int, ...] = ()  # () = 1, 2, 4, 8, 16, ... up to max_num_seqs
    seq_len_buckets: tuple[int, ...] = ()  # max_seq_len host ints captured; () = max_model_len
    strict_capture: bool = False  # a failed capture raises (default: warned and counted)
    # Persistent Inductor cache (compile_cache.py): None = ~/.cache/compiled_spec/inductor (or
    # an exported TORCHINDUCTOR_CACHE_DIR), a path = that directory, "" = Inductor's default.
    cache_dir: str | None = None
    # Inductor benchmarks its Triton GEMM templates against cuBLAS for every matmul shape it
    # compiles and keeps the faster (fusing the epilogue when a template wins). SmolLM2's
    # GEMMs are latency-bound (~3.9 us per cuBLAS call for ~1 MB of weights: ~half of the GPU
    # kernel time of a chain step in the H200 trace, results/2026-12-01_h200_session7/trees.log);
    # compiling takes longer.
    autotune_gemm: bool = False
    # The target's residual adds folded into skinny-GEMM ops (passes.skinny_gemm; one Triton
    # launch each at decode sizes). None = decided per target (compiled_spec/gemm_policy.py:
    # on for CUDA and 16-bit dtypes, where SmolLM2's bench rows and the 8B shape's decode
    # measured faster; off for fp32, measured slower).
    skinny_gemm: bool | None = None
    # With skinny_gemm: gate_up's SiLU-and-mul and qkv's rope + KV write folded into their
    # GEMMs too (8 kernels per decoder layer instead of 10 at decode sizes). None = as
    # skinny_gemm resolves.
    skinny_gemm_layer: bool | None = None
    # With skinny_gemm: the RMSNorms folded into the GEMMs after them as well. Slower on the
    # H200 (the norm costs the GEMM more than Inductor's norm kernel); for benchmarks.
    skinny_gemm_norms: bool = False
    # With skinny_gemm: the target's lm_head through our skinny GEMM too, at decode sizes, in
    # its eager logits and its graphs' alike (``CausalLM.readout``; never for a sharded one).
    # None = with skinny_gemm for lm_heads of READOUT_MIN_WEIGHT elements and more
    # (compiled_spec/gemm_policy.py: the 8B shape's took 345.7 against cuBLAS's 373.0 us at
    # M = 1 on the H100, forty-sixth session; SmolLM2's is not timed end to end with it).
    skinny_gemm_readout: bool | None = None
    # The same fusions (as skinny_gemm / skinny_gemm_layer / skinny_gemm_norms resolve for the
    # target) in the draft's compiled callables too: first pass, step, step + pick, pick + plan,
    # the tree's expansion. Why: the chain's propose at batch 1 was 100 kernels with cuBLAS
    # GEMMs, the tree's 175 (H100 traces, thirty-third session). None = whenever the target's
    # skinny GEMMs are on: on an H100 (thirty-fourth session, three A/B processes, EAGLE-3 k=5
    # at batch 1-64) the propose call took less time in 8 of 11 pairs, one a tie (up to 23%
    # less at batch 64), and fp32 output stayed vanilla's on 10 / 10 prompts.
    skinny_gemm_draft: bool | None = None
    # With skinny_gemm: calls of 65-256 rows (a tree's verify of 48 nodes x 4 requests, a
    # chain's 6 x 16) through the fused kernels too, in tiles of 64 rows, instead of cuBLAS
    # and the norm, SiLU-and-mul and rope + KV kernels around it (kernels.gemm_config). Off
    # until timed on a GPU (`compiled-spec bench --ab skinny_gemm_wide`).
    skinny_gemm_wide: bool = False
    # Issue 16: save the target's Dynamo + Inductor result (torch's aot_compile) in the compile
    # cache and load it on the next start-up instead of tracing (compiled_spec/precompile.py).
    # None = on for CUDA engines: a warm start on the H200 (torch 2.11) took 5.1-6.7 s with it,
    # 12.8-13.7 s without (eighteenth session). Off by default on the CPU, where engines are
    # mostly tests and CI runs that start cold: there the aot_compile save only adds time.
    precompile: bool | None = None
    # Programmatic dependent launch (Hopper and newer) for Inductor's Triton kernels and ours
    # (kernels/dispatch.py, ours for launches of up to 64 rows): a kernel launches while its
    # predecessor drains and waits on-device for its inputs. With the fused layer, SmolLM2's
    # vanilla batch 1 went from 0.98 to 0.78 ms/token on the H200, but EAGLE-3's 96-row verify
    # got slower (thirtieth session). None = decided per engine and model (pdl_policy.py: on
    # with the fused layer when the model's widest decode call is at most 64 rows, and on
    # the narrow calls of a wider engine, see pdl_narrow).
    pdl: bool | None = None
    # An engine whose widest decode call passes 64 rows compiles its target a second time
    # with PDL for the graphs of at most 64 rows (decode, small verifies, short prompts) and
    # keeps the wide ones without, so its batch-1 and paused steps get PDL as a vanilla
    # engine's do (vanilla batch 1: 0.764 ms/token with PDL against a 64-request EAGLE-3
    # engine's paused 0.935 ms without, H100, fortieth session). With the split, that engine
    # ran 2377.1 tok/s at batch 1 against 2205.8 without (H200, forty-first session,
    # profiles/results/2026-12-06_h200_session41/). Costs one target compile at a cold start.
    # None = where pdl resolves on (auto) and the engine is wide; True = also with pdl=True;
    # False = never (one target compile: PDL on every call or on none).
    pdl_narrow: bool | None = None
    # One-sequence prompt steps of up to this many query tokens replay CUDA graphs padded to
    # 16, 32, ... tokens (capture.policy.prefill_sizes); 0 = none. Why: without a graph a
    # prompt step was host-bound at 15-40 ms on the H200 (SmolLM2: ~360 launches through
    # Python) against 1-3 ms for a decode step; at batch 1 every request starts with one.
    # A draft's pass over those prompts replays graphs of the same token counts (and of
    # mixed_graph_tokens' below; engine/draft_prefill_graph.py).
    prefill_graph_tokens: int = 512
    # Prompt steps of several sequences (and the requests decoding beside them) of up to this
    # many tokens replay varlen CUDA graphs padded to 128, 256, ... tokens
    # (capture.policy.mixed_sizes), each prompt at most the largest prefill graph's length;
    # 0 = none. Why: issue 16, the steady state at batch 64 (graphs.py).
    mixed_graph_tokens: int = 8192
    # Issue 16 (cold start): Dynamo specializes a dynamic dimension whose first size is 0 or 1,
    # so batch 1's decode (1 token, 1 sequence) and the prompt graphs each compiled the whole
    # target (H200, 27th session: ~20 s apiece of a ~60 s cold start). Size-oblivious symbols
    # (torch's backed_size_oblivious, as vLLM offers) keep size 1 symbolic: one graph serves
    # every size. Scoped to our compiled calls, as use_duck_shape is.
    size_oblivious: bool = True
    # Issue 16: a sampled step's draws (temperature, top-k / top-p, the counter-based draw:
    # ~90 small kernels) replay one CUDA graph (engine/sample_graph.py); False: eager.
    sample_graphs: bool = True
    # Issue 16: those draws compiled (our backend, Inductor where ``inductor``) before they are
    # captured: a handful of fused kernels instead of ~90, each pass over [rows, vocab] once.
    # On the H100 (fifty-seventh session) a sampled vanilla step took 0.94 ms at batch 1 and
    # 1.16 ms at 64 against a greedy one's 0.80 / 0.86: the draw's own GPU time, between two
    # decode steps. One more compile per sorting mode at a cold start; off until measured.
    sample_compile: bool = False

    def __post_init__(self) -> None:
        for name in ("inductor", "dynamic", "cudagraphs", "strict_capture", "autotune_gemm",
                     "skinny_gemm_norms", "size_oblivious", "skinny_gemm_wide", "sample_graphs",
                     "sample_compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CompileConfig.{name}={getattr(self, name)!r}: must be a bool")
        for name in ("skinny_gemm", "skinny_gemm_layer", "skinny_gemm_draft",
                     "skinny_gemm_readout"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise ValueError(f"CompileConfig.{name}={getattr(self, name)!r}: a bool, or "
                                 "None (decided per target)")
        for name in ("prefill_graph_tokens", "mixed_graph_tokens"):
            t = getattr(self, name)
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"CompileConfig.{name}={t!r}: an integer >= 0")
        if self.pdl is not None and not isinstance(self.pdl, bool):
            raise ValueError(f"CompileConfig.pdl={self.pdl!r}: a bool, or None (decided per "
                             "engine)")
        if self.pdl_narrow is not None and not isinstance(self.pdl_narrow, bool):
            raise ValueError(f"CompileConfig.pdl_narrow={self.pdl_narrow!r}: a bool, or None "
                             "(narrow calls of a wide engine get PDL where PDL is auto)")
        if self.pdl_narrow and self.pdl is False:
            raise ValueError("CompileConfig.pdl_narrow=True needs pdl True or None")
        if self.precompile is not None and not isinstance(self.precompile, bool):
            raise ValueError(f"CompileConfig.precompile={self.precompile!r}: a bool, or None "
                             "(on for CUDA engines)")
        for opt in ("skinny_gemm_layer", "skinny_gemm_norms"):
            if getattr(self, opt) and self.skinny_gemm is not True:
                raise ValueError(f"CompileConfig.{opt}=True needs skinny_gemm=True")
        if self.skinny_gemm_wide and self.skinny_gemm is False:
            raise ValueError("CompileConfig.skinny_gemm_wide=True needs skinny_gemm True or "
                             "None (it widens the skinny GEMMs)")
        if self.skinny_gemm_draft and self.skinny_gemm is False:
            raise ValueError("CompileConfig.skinny_gemm_draft=True needs skinny_gemm True or "
                             "None (the draft takes the target's fusions)")
        if self.pdl and not hasattr(torch._inductor.config.triton, "enable_pdl"):
            raise ValueError(f"CompileConfig.pdl=True: torch {torch.__version__}'s Inductor has "
                             "no triton.enable_pdl option")
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, Path)):
            raise ValueError(f"CompileConfig.cache_dir={self.cache_dir!r}: a path, '' or None")
        if isinstance(self.cache_dir, Path):
            self.cache_dir = str(self.cache_dir)
        self.capture_batch_sizes = tuple(self.capture_batch_sizes)
        self.seq_len_buckets = tuple(self.seq_len_buckets)
