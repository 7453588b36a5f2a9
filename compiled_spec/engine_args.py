"""The options that build an engine, shared by every command that builds one (``compiled-spec
generate / bench / parity / profile / acceptance``): the argparse flags and their mapping onto
``LLM(**kwargs)``.

It sits below both the CLI and the command modules (``acceptance.py``, ``profile_run.py``), which
read the parsed options back through ``engine_kwargs``, so neither imports ``cli.py``.
"""
from __future__ import annotations

import argparse

# The CompileConfig flags the engine options set, and their values when a command leaves them
# out (None: the engine decides, compiled_spec/gemm_policy.py and pdl_policy.py). Every command
# that builds engines (and the bench, which builds several) reads them through this one list.
COMPILE_FLAGS: dict[str, bool | None] = {
    "autotune_gemm": False, "skinny_gemm": None, "skinny_gemm_layer": None,
    "skinny_gemm_norms": False, "skinny_gemm_draft": None, "skinny_gemm_wide": False,
    "skinny_gemm_readout": None, "precompile": None, "pdl": None, "pdl_narrow": None,
    "sample_graphs": True, "sample_compile": False}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="prompt tokens admitted per step")
    p.add_argument("--min-admit", type=int, default=None, metavar="N",
                   help="while requests run, start waiting ones only N at a time (or all that "
                   "wait): fewer, larger prefill steps (default: max-num-seqs / 4; 1: at once)")
    p.add_argument("--draft", default=None, help="EAGLE-1 / EAGLE-3 head directory (HF layout), or "
                   "smollm2-eagle3 (the head shipped for the default SmolLM2 target)")
    p.add_argument("--method", default=None, choices=["eagle", "eagle3"],
                   help="draft method (default: detected from the checkpoint)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=3)
    p.add_argument("--draft-sampling", default="argmax", choices=["argmax", "sample"])
    p.add_argument("--compile", action="store_true", help="torch.compile target and draft (our backend)")
    p.add_argument("--compile-cache-dir", default=None, metavar="DIR",
                   help="persistent Inductor cache (default ~/.cache/compiled_spec/inductor, or "
                   "an exported TORCHINDUCTOR_CACHE_DIR; '' = Inductor's own default)")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="batch sizes to capture CUDA graphs for (default: 1, 2, 4, then every "
                   "multiple of 8 up to --max-num-seqs; fewer sizes start up faster)")
    p.add_argument("--autotune-gemm", action="store_true",
                   help="with --compile: Inductor times its Triton GEMM templates against cuBLAS "
                   "per matmul shape and keeps the faster (longer compile)")
    p.add_argument("--skinny-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="with --compile: the target's residual adds fused into Triton GEMMs for "
                   "few rows (passes.skinny_gemm; CUDA, M <= 64; default: on for CUDA, 16-bit "
                   "dtypes and small layer weights, compiled_spec/gemm_policy.py)")
    p.add_argument("--skinny-gemm-layer", action=argparse.BooleanOptionalAction, default=None,
                   help="with the skinny GEMMs: gate_up's SiLU-and-mul and qkv's rope + KV write "
                   "fused into them too (8 kernels per decoder layer instead of 10; default: "
                   "with the skinny GEMMs)")
    p.add_argument("--skinny-gemm-norms", action="store_true",
                   help="with --skinny-gemm: the RMSNorms fused into the GEMMs too (slower on "
                   "the H200; for benchmarks)")
    p.add_argument("--skinny-gemm-wide", action="store_true",
                   help="with the skinny GEMMs: calls of 65-256 rows (wide verifies) through the "
                   "fused kernels too, in tiles of 64 rows (off until timed on a GPU)")
    p.add_argument("--skinny-gemm-readout", action=argparse.BooleanOptionalAction, default=None,
                   help="with the skinny GEMMs: the target's lm_head through them too at decode "
                   "sizes (default: for lm_heads of 100M elements and more)")
    p.add_argument("--skinny-gemm-draft", action=argparse.BooleanOptionalAction, default=None,
                   help="with the skinny GEMMs: the draft's compiled callables take the target's "
                   "fusions too (first pass, draft steps, tree expansion; default: whenever "
                   "the target's are on)")
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="with --compile: Inductor's Triton kernels and ours (up to 64 rows) use "
                   "programmatic dependent launch (Hopper and newer; shortens the gaps between "
                   "kernels; default: on with the fused layer when the widest decode call, "
                   "max_num_seqs x rows per request, is at most 64 rows; the target and the "
                   "draft decide by their own)")
    p.add_argument("--pdl-narrow", action=argparse.BooleanOptionalAction, default=None,
                   help="with --compile: an engine whose widest decode call passes 64 rows "
                   "compiles its target twice, with PDL for the graphs of at most 64 rows "
                   "(decode, small verifies) and without for the wider ones (default: where "
                   "--pdl is left to the engine; --no-pdl-narrow: one target compile)")
    p.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=None,
                   help="with --compile: save the target's compiled result (torch's aot_compile) "
                   "in the compile cache and load it on later starts instead of tracing "
                   "(default: on for CUDA)")
    p.add_argument("--sample-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="with --compile: a sampled step's draws (temperature, top-k / top-p, "
                   "the seeded draw) replay one CUDA graph (--no-sample-graphs: eager)")
    p.add_argument("--sample-compile", action=argparse.BooleanOptionalAction, default=False,
                   help="with --compile: those draws compiled (Inductor) before they are "
                   "captured: fewer kernels a sampled step (default: off)")
    p.add_argument("--speculative-topk", type=int, default=1, help="> 1: EAGLE-2 draft trees")
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="tree verification budget, root included")
    p.add_argument("--speculation-policy", default=None, choices=["always", "adaptive"],
                   help="adaptive: pause drafting where measured step costs and acceptance say "
                   "plain decoding is faster (chains only; default: adaptive for chains on "
                   "CUDA, always otherwise)")
    p.add_argument("--adaptive-k", type=int, nargs="+", default=(), metavar="K",
                   help="with --speculation-policy adaptive: smaller draft counts the policy may "
                   "verify instead of -k where that is faster (k shrinks; verify graphs each)")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--draft-tensor-parallel", action="store_true",
                   help="shard the draft too (default: replicated on every rank)")


def add_prompt_args(p: argparse.ArgumentParser, num_prompts: int, max_tokens: int) -> None:
    """MT-bench first turns (chat template applied) and how many tokens to write for each."""
    from compiled_spec.data import mt_bench_path

    p.add_argument("--prompts", default=str(mt_bench_path()),
                   help="JSONL with 'turns' or 'prompt' (default: MT-bench, shipped in the package)")
    p.add_argument("--num-prompts", type=int, default=num_prompts)
    p.add_argument("--max-tokens", type=int, default=max_tokens)


def engine_kwargs(a: argparse.Namespace) -> dict:
    """``LLM(**engine_kwargs(a))`` builds the engine that ``add_engine_args`` describes."""
    kw = dict(model=a.model, dtype=a.dtype, device=a.device, max_model_len=a.max_model_len,
              page_size=a.page_size, max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=getattr(a, "max_num_batched_tokens", 4096),
              min_admit=getattr(a, "min_admit", None), draft=a.draft, method=a.method,
              num_speculative_tokens=a.num_speculative_tokens, draft_sampling=a.draft_sampling,
              compile=a.compile, speculative_topk=a.speculative_topk,
              speculative_num_draft_tokens=a.speculative_num_draft_tokens,
              speculation_policy=getattr(a, "speculation_policy", None),
              adaptive_k=tuple(getattr(a, "adaptive_k", ())),
              enable_prefix_caching=a.enable_prefix_caching,
              tensor_parallel_size=a.tensor_parallel_size,
              draft_tensor_parallel=a.draft_tensor_parallel)
    sizes = getattr(a, "cuda_graph_sizes", None)
    flags = compile_flags(a)
    if a.compile_cache_dir is not None or sizes or flags != COMPILE_FLAGS:
        from compiled_spec.compile import CompileConfig

        kw["compile_config"] = CompileConfig(cache_dir=a.compile_cache_dir,
                                             capture_batch_sizes=tuple(sizes or ()), **flags)
    return kw


def compile_flags(a: argparse.Namespace) -> dict[str, bool | None]:
    """The ``COMPILE_FLAGS`` as ``a`` sets them (commands without a flag get its default)."""
    return {name: getattr(a, name, default) for name, default in COMPILE_FLAGS.items()}
