"""H200: what compile + CUDA graphs buy, per component and end to end (issue 4's figures).

One shape per run (a target and an EAGLE-3 head):
  python profiles/scripts/graphs_h200.py --shape smollm2 --model ~/m/model.gguf --draft HEAD --out F.json
  python profiles/scripts/graphs_h200.py --shape llama8b --out F.json   (random Llama-3.1-8B + 32k head)
  python profiles/scripts/graphs_h200.py --shape smollm2-random --tokenizer TOK --out F.json
      (SmolLM2-135M's shape with random weights: no GGUF to carry; --[no-]skinny-gemm
      [--[no-]skinny-gemm-layer] [--skinny-gemm-norms] A/B the fused decoder-layer GEMMs)

Reports start-up (load; torch.compile + capture by dummy runs), then at a 512-token context and
batch 1: the target forward at T = 1 / 4 / 8 tokens (eager, compiled, compiled + graph) and the
whole propose call for k = 3 and 5 (eager, compiled, compiled + graph), against the weight-read
floor (bytes / the read bandwidth measured on this GPU: a sum over 2 GiB; 4.27 TB/s on a CPU dry run). "ms" is one call followed by a device sync (what a step waits for);
"ms_pipelined" is the mean of back-to-back calls with one sync at the end. With --e2e, MT-bench
prompts are generated vanilla and speculative (k=5) eager and compiled: ms/token, tau, and
whether greedy outputs are identical. --autotune-gemm: the same with Inductor's GEMM
autotuning (``CompileConfig.autotune_gemm``), to compare per-kernel tables.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from capture import CapturePolicy, LiveBatch, StaticBuffers  # noqa: E402
from compiled_spec import LLM, SamplingParams  # noqa: E402
from compiled_spec.compile import CompileConfig, capture_graphs, use_compiled  # noqa: E402
from compiled_spec.engine.batch import Span, build_metadata  # noqa: E402
from compiled_spec.engine.graphs import EngineGraphs  # noqa: E402
from compiled_spec.bench.run import LLAMA8B, SMOLLM2, TINY  # noqa: E402

RANDOM_SHAPES = {"llama8b": LLAMA8B, "tiny": TINY, "smollm2-random": SMOLLM2}
from compiled_spec.bench.timing import HBM_BYTES_PER_S, read_bandwidth, weight_bytes  # noqa: E402
from compiled_spec.spec.proposer import ProposeBatch  # noqa: E402

CTX = 512
DEVICE = torch.device("cuda")
EMULATE = False  # CPU dry run: emulated graphs (capture.emulate)


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def timeit(fn: Callable[[], Any], iters: int = 50, warmup: int = 5) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    pipelined = (time.perf_counter() - t0) / iters * 1e3
    each = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        each.append((time.perf_counter() - t0) * 1e3)
    return {"ms": round(statistics.median(each), 4), "ms_pipelined": round(pipelined, 4)}


def kernel_profile(fn: Callable[[], Any], calls: int = 10) -> dict[str, Any]:
    """GPU kernels per call of ``fn`` (a graph replay launches the same kernels as the compiled
    code it captured): how many, their summed device time, and the costliest by name."""
    if DEVICE.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    rows = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total_us = sum(e.self_device_time_total for e in rows) / calls
    top = sorted(rows, key=lambda e: -e.self_device_time_total)[:12]
    return {"kernels_per_call": round(sum(e.count for e in rows) / calls, 1),
            "device_us_per_call": round(total_us, 1),
            "top": [{"name": e.key[:90], "per_call": round(e.count / calls, 1),
                     "us_per_call": round(e.self_device_time_total / calls, 1)} for e in top]}


def build(args: argparse.Namespace, tmp: Path) -> tuple[LLM, float]:
    from compiled_spec.draft.testing import write_eagle3_head
    from compiled_spec.models.config import ModelConfig

    model, draft = args.model, args.draft
    if args.shape in RANDOM_SHAPES:
        cfg = RANDOM_SHAPES[args.shape]
        (tmp / "t").mkdir()
        (tmp / "t" / "config.json").write_text(json.dumps(cfg))
        model = f"random:{tmp / 't'}"
        layers = cfg["num_hidden_layers"]
        draft = write_eagle3_head(str(tmp / "head"), ModelConfig.from_hf_dict(cfg),
                                  draft_vocab_size=32000,
                                  aux_layer_ids=(2, layers // 2, layers - 3))
    t0 = time.perf_counter()
    llm = LLM(model=model, tokenizer=args.tokenizer, draft=draft, method="eagle3",
              num_speculative_tokens=5, speculation_policy="always", device=DEVICE, max_model_len=2048,
              dtype="bfloat16" if DEVICE.type == "cuda" else "float32",
              max_num_seqs=1, kv_cache_memory_gib=4,
              compile_config=CompileConfig(capture_batch_sizes=(1,), inductor=args.inductor,
                                           autotune_gemm=args.autotune_gemm,
                                           precompile=args.precompile,
                                           skinny_gemm=args.skinny_gemm,
                                           skinny_gemm_layer=args.skinny_gemm_layer,
                                           skinny_gemm_norms=args.skinny_gemm_norms,
                                           skinny_gemm_readout=args.skinny_gemm_readout,
                                           pdl=args.pdl))
    return llm, time.perf_counter() - t0


def component_latencies(llm: LLM, skip_eager: bool) -> dict[str, Any]:
    runner, models = llm.engine.runner, llm._compiled
    prop, alloc, dev = runner.proposer, llm.engine.allocator, DEVICE
    rid = 10 ** 9  # a fake request owning a CTX-token context (KV contents do not matter)
    alloc.grow(rid, CTX + 32)
    aux_ids = runner.aux_layer_ids
    vocab = runner.model.config.vocab_size
    graphs: EngineGraphs = models.graphs
    policy = graphs.policy
    out: dict[str, Any] = {"target": {}, "propose": {}, "kernels": {}}

    # Target forward at T tokens; each T gets its own graph here (the engine's verify graph
    # is T = k + 1 = 6), captured into the same pool from the same compiled function.
    max_blocks = graphs.registry.runners["target_decode"].buffers.max_blocks
    fn = models.compiled["target"]
    for t in (1, 4, 8):
        ids = torch.randint(0, vocab, (t,), device=dev)
        pos, meta = build_metadata(alloc, [Span(rid, CTX, t)], dev)
        live = LiveBatch(ids, pos, meta)
        # T = 1 too gets its own graph: a chain engine captures no 1-token decode graph
        # (capture.policy.decode_sizes), its single-request decode replays the verify graph.
        runner_t = graphs.registry.register(
            f"bench_target_T{t}", lambda b: fn(b.input_ids, b.positions, b.meta, aux_ids),
            [t], StaticBuffers(t, 1, max_blocks, dev), query_len=t, clone_outputs=True,
            seq_len_buckets=policy.seq_len_buckets)
        runner_t.capture()
        with torch.inference_mode():
            out["target"][f"T{t}"] = {} if skip_eager else {
                "eager": timeit(lambda: models.eager["target"](ids, pos, meta, aux_ids)),
                "compiled": timeit(lambda: fn(ids, pos, meta, aux_ids))}
            out["target"][f"T{t}"].update({
                "compiled_graph": timeit(lambda: runner_t.run(live)),
                # What a step pays: the lm_head runs after the replay, on the rows it needs.
                "compiled_graph_with_lm_head": timeit(
                    lambda: runner.model.compute_logits(runner_t.run(live)[0]))})
            if t in (1, 8):
                out["kernels"][f"target_T{t}"] = kernel_profile(lambda: runner_t.run(live))
        print(f"target T={t}: {out['target'][f'T{t}']}", flush=True)

    # The whole propose call (host metadata, eager fc, first pass, k-1 steps) for one request
    # whose last step accepted one draft (first pass over 2 positions).
    m = 2
    with torch.inference_mode():
        ids = torch.randint(0, vocab, (m,), device=dev)
        pos, meta = build_metadata(alloc, [Span(rid, CTX - m, m)], dev)
        _, aux = models.eager["target"](ids, pos, meta, aux_ids)
    for k in (3, 5):
        prop.k = k
        batch = ProposeBatch(first_pass=[Span(rid, CTX - m, m)], token_ids=[5] * m,
                             hidden_rows=list(range(m)), step_limits=[CTX - 1 + k],
                             temperature=[0.0], seeds=[0])
        res: dict[str, Any] = {}
        saved = models.graphs
        if not skip_eager:
            use_compiled(runner, models, False)
            res["eager"] = timeit(lambda: prop.propose(batch, aux))
            models.graphs = None
            use_compiled(runner, models, True)  # compiled, no graphs
            res["compiled"] = timeit(lambda: prop.propose(batch, aux))
        if k == 5:
            models.graphs = saved
        else:  # graphs for k = 3: another first-pass size and a 2-step loop
            t0 = time.perf_counter()
            runner.k = 3
            # Early propose's graphs replay the pick + plan compiled for the engine's k (5):
            # they cannot serve k = 3, and this table times the plain propose call anyway.
            early, runner.early = runner.early, None
            models.graphs = EngineGraphs(runner, fn, CapturePolicy(1, 3, policy.max_model_len,
                                                                   batch_sizes=(1,)),
                                         llm.config.cache.page_size, emulate=EMULATE)
            models.graphs.capture()
            runner.early = early
            res["capture_k3_s"] = round(time.perf_counter() - t0, 2)
            runner.k = 5
        use_compiled(runner, models, True)
        res["compiled_graph"] = timeit(lambda: prop.propose(batch, aux))
        out["kernels"][f"propose_k{k}"] = kernel_profile(lambda: prop.propose(batch, aux))
        models.graphs = saved
        use_compiled(runner, models, True)
        out["propose"][f"k{k}"] = res
        print(f"propose k={k}: {res}", flush=True)
    prop.k = 5
    alloc.free(rid)
    return out


def end_to_end(llm: LLM, prompts_file: str, n: int, max_tokens: int, skip_eager: bool
               ) -> dict[str, Any]:
    from compiled_spec.bench import load_mt_bench, mt_bench_prompts

    prompts = mt_bench_prompts(llm, load_mt_bench(prompts_file, n))
    res: dict[str, Any] = {}
    outs: dict[str, list] = {}
    for compiled in ((True,) if skip_eager else (False, True)):
        llm.set_compiled(compiled)
        for spec in (False, True):
            sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, speculate=spec)
            llm.generate(prompts[:1], SamplingParams(max_tokens=8, speculate=spec),
                         use_tqdm=False)  # warm
            d0, a0 = llm.stats.spec.num_drafting_steps, llm.stats.spec.num_accepted_tokens
            sync()
            t0 = time.perf_counter()
            toks = 0
            got = []
            for p in prompts:  # batch 1
                o = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
                got.append(o)
                toks += len(o)
            sync()
            dt = time.perf_counter() - t0
            name = ("compiled_graph" if compiled else "eager") + ("_eagle3" if spec else
                                                                  "_vanilla")
            d = llm.stats.spec.num_drafting_steps - d0
            a = llm.stats.spec.num_accepted_tokens - a0
            res[name] = {"ms_per_token": round(dt / toks * 1e3, 4), "tokens": toks,
                         "tau": round(1 + a / d, 4) if spec and d else None}
            outs[name] = got
            print(name, res[name], flush=True)
    # bf16: speculative and vanilla run different kernels (T = k+1 vs 1), so identical greedy
    # output is expected for most prompts, not all; fp32 identity is what the tests check.
    for ref_name in ("eager_vanilla", "compiled_graph_vanilla"):
        if ref_name in outs:
            ref = outs[ref_name]
            res[f"identical_to_{ref_name}"] = {
                k: sum(a == b for a, b in zip(v, ref)) / len(ref) for k, v in outs.items()}
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=["smollm2", *RANDOM_SHAPES], required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run with emulated graphs")
    ap.add_argument("--no-inductor", dest="inductor", action="store_false")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--prompts", default=".device/data/question.jsonl")
    ap.add_argument("--e2e", type=int, default=0, help="MT-bench prompts for the end-to-end run")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    ap.add_argument("--autotune-gemm", action="store_true",
                    help="Inductor's GEMM autotuning (Triton templates vs cuBLAS per shape)")
    ap.add_argument("--skinny-gemm", action=argparse.BooleanOptionalAction, default=None,
                    help="the target's residual adds fused into our skinny GEMMs (default: the "
                         "engine's, compiled_spec/gemm_policy.py)")
    ap.add_argument("--skinny-gemm-layer", action=argparse.BooleanOptionalAction, default=None,
                    help="with the skinny GEMMs: SiLU-and-mul and rope + KV write too")
    ap.add_argument("--skinny-gemm-norms", action="store_true",
                    help="with --skinny-gemm: the RMSNorms too")
    ap.add_argument("--skinny-gemm-readout", action=argparse.BooleanOptionalAction, default=None,
                    help="with the skinny GEMMs: the lm_head too (default: the engine's)")
    ap.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                    help="Inductor's kernels and ours with programmatic dependent launch "
                         "(CompileConfig.pdl; default: the engine's, pdl_policy.pdl_auto; "
                         "before the forty-ninth session off unless given)")
    ap.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=None,
                    help="the target from torch's aot_compile artifacts (default: on for CUDA)")
    ap.add_argument("--startup-only", action="store_true",
                    help="issue 16's warm start: load, compile and capture, report start-up "
                         "(llm.startup_s, compile-cache hits, precompile loads) and stop")
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], default=None,
                    help="torch's BLAS library for the GEMMs Inductor leaves to ATen (default: "
                         "torch's choice, cuBLAS): cuBLASLt may reduce split-K inside the GEMM "
                         "where cuBLAS launches a separate reduce kernel")
    ap.add_argument("--skip-eager", action="store_true",
                    help="time only the compiled + graph paths (eager and compiled-only measured "
                         "before)")
    args = ap.parse_args()
    global DEVICE, EMULATE
    DEVICE = torch.device(args.device)
    EMULATE = DEVICE.type == "cpu"
    if args.blas and DEVICE.type == "cuda":
        torch.backends.cuda.preferred_blas_library(args.blas)
    report: dict[str, Any] = {"shape": args.shape, "torch": torch.__version__, "blas": args.blas,
                              "gpu": torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", "context": CTX, "batch": 1,
                              "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory() as tmp:
        llm, build_s = build(args, Path(tmp))
        report["load_s"] = round(build_s, 2)
        t0 = time.perf_counter()
        llm.set_compiled(True)  # torch.compile (dynamic) + capture of every component
        if DEVICE.type == "cpu":  # dry run: emulated graphs
            c = llm.config
            capture_graphs(llm.engine.runner, llm._compiled, CapturePolicy(
                1, 5, c.max_model_len, batch_sizes=(1,)), c.cache.page_size, emulate=True)
        report["compile_and_capture_s"] = round(time.perf_counter() - t0, 2)
        report["capture_s"] = round(llm._compiled.graphs.capture_s, 2)
        report["startup_s"] = {k: round(v, 3) for k, v in llm.startup_s.items()}
        report["startup_detail_s"] = {k: round(v, 3) for k, v in llm.startup_detail_s.items()}
        report["compile_cache"] = llm.compile_cache
        report["kernel_warmup"] = llm.engine.kernel_warmup  # parallel_* keys: workers compiled
        cm = llm._compiled  # PDL as resolved: its launches use GDC=1 attention binaries
        report["pdl"] = {"target": cm.pdl and cm.pdl.why,
                         "draft": cm.pdl_draft and cm.pdl_draft.why}
        print("start-up", report, flush=True)
        if args.startup_only:
            Path(args.out).write_text(json.dumps(report, indent=1, default=str))
            return 0
        tgt, drf = llm.engine.model, llm.engine.runner.proposer.draft
        t_bytes = weight_bytes(tgt)
        d_bytes = weight_bytes(drf, exclude=tgt)
        # measured here (4.27e12 was the H200's; an H100's is lower, so a fixed constant
        # misstates the ratio); the H200's on a CPU dry run
        bw = HBM_BYTES_PER_S["NVIDIA H200"] if EMULATE else read_bandwidth(DEVICE)
        report["read_tb_s"] = round(bw / 1e12, 3)
        report["floor_ms"] = {"target": round(t_bytes / bw * 1e3, 4),
                              "draft_step": round(d_bytes / bw * 1e3, 4)}
        print(f"floor at {bw / 1e12:.3f} TB/s: {report['floor_ms']}", flush=True)
        report.update(component_latencies(llm, args.skip_eager))
        if args.e2e:
            report["e2e"] = end_to_end(llm, args.prompts, args.e2e, args.max_tokens,
                                       args.skip_eager)
        report["graph_stats"] = llm.compile_stats.get("cuda_graphs")
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: report[k] for k in ("floor_ms", "target", "propose", "kernels")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
