"""Time the skinny GEMM (``kernels.skinny_gemm_triton``) against cuBLAS and Inductor on
SmolLM2-135M's shapes at batch-1 decode / verify sizes, bf16.

Run on a GPU as ``PYTHONPATH=. python -m kernels.bench_gemm --out $OUT/gemm.json``; ``--dry-run``
runs every section on tiny shapes on the CPU (set TRITON_INTERPRET=1 itself) to check the script.
Each timing replays a CUDA graph of calls, so it shows GPU time, not Python launch overhead, as
in the engine. The calls cycle through enough copies of the weight to overflow the L2 cache:
in the model each layer reads different weights, so a GEMM never finds its weights L2-hot.
Sections (each with its own time budget; what is left when it runs out is skipped, with a note):
  linear:   F.linear (cuBLAS) vs our kernel under each candidate config (* = gemm_config's pick)
  inductor: torch.compile(mode="max-autotune-no-cudagraphs") of F.linear
  fused:    the unfused ops compiled by Inductor as the engine runs them (norm / silu*mul /
            residual kernels + cuBLAS) vs one fused launch of ours under each candidate config
            (the decoder layer as ``--skinny-gemm --skinny-gemm-layer --skinny-gemm-norms``
            runs it: RMSNorm + qkv, o_proj + residual, RMSNorm + gate_up + SiLU-and-mul,
            down + residual; qkv's rope + KV write: profiles/scripts/fused_layer_gemms_h200.py)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kernels.graph_timer import graph_us

SHAPES = {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072),
          "down": (1536, 576), "lm_head": (576, 49152)}  # name: (K, N)
# Llama-3.1-8B's layer GEMMs (--model llama8b): cuBLAS streams its gate_up / down at ~4 TB/s
# but qkv / o_proj at ~3.1 (H200 kernel table, thirtieth session), where ours may win per GEMM
# and its lm_head (128k vocabulary, 1.05 GB: cuBLAS took 0.395 ms of the decode call on the H100
# in the forty-fifth session, 1.16x its read at the measured bandwidth)
LLAMA8B = {"qkv": (4096, 6144), "o_proj": (4096, 4096), "gate_up": (4096, 28672),
           "down": (14336, 4096), "lm_head": (4096, 128256)}
MODELS = {"smollm2": SHAPES, "llama8b": LLAMA8B}
MS = (1, 6, 16, 48, 2, 4, 8, 32)  # the sizes that matter most first, in case time runs out
LAYER_GEMMS = ("qkv", "o_proj", "gate_up", "down")
# (variant, shape, prologue, epilogue): the fusions the decoder layer offers
FUSED = [("rmsnorm+qkv", "qkv", "rmsnorm", None), ("o_proj+residual", "o_proj", None, "residual"),
         ("rmsnorm+gate_up+silu_mul", "gate_up", "rmsnorm", "gated"),
         ("down+residual", "down", None, "residual"),
         ("rmsnorm+lm_head", "lm_head", "rmsnorm", None)]
# Seconds per section, checked between cases (one case, an autotuned compile, can run over):
# the default run stays inside a 10-minute device call; results are saved after each section.
LIMITS = {"linear": 150.0, "inductor": 150.0, "fused": 90.0}
FLUSH_BYTES = 192 << 20  # weight copies cycled per timing: more than the H200's 50 MB of L2
EPS = 1e-5


class Section:
    """A time budget; ``over()`` records (once) that the rest of the section was skipped."""

    def __init__(self, name: str, limit_s: float, notes: list[str]) -> None:
        self.name, self.limit_s, self.notes = name, limit_s, notes
        self.t0 = time.perf_counter()
        self.skipped = 0

    def over(self) -> bool:
        if time.perf_counter() - self.t0 < self.limit_s:
            return False
        if self.skipped == 0:
            self.notes.append(f"{self.name}: time limit {self.limit_s:.0f} s reached; "
                              "later cases skipped")
        self.skipped += 1
        return True


def time_us(fn: Callable[[int], object], copies: int, iters: int = 10) -> float:
    """Mean microseconds per call of fn(i), i cycling over the weight copies. CUDA: a graph of
    one call per copy, replayed; CPU (dry run): wall clock, for the script's sake only."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for i in range(copies):
            fn(i)
        return (time.perf_counter() - t0) * 1e6 / copies
    return graph_us(fn, copies, iters)


class Case:
    """Inputs of one (shape, M, prologue, epilogue) with the weight copied to defeat the L2;
    a gated case's N is the weight's ([gate; up]), its output has N / 2 columns."""

    def __init__(self, k: int, n: int, m: int, prologue: str | None, epilogue: str | None,
                 dev: str, dtype: torch.dtype, max_copies: int) -> None:
        g = torch.Generator().manual_seed(m * 7919 + n)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

        self.x = rand(m, k)  # [M, K]
        w = rand(n, k, scale=k ** -0.5)  # [N, K]
        self.copies = max(1, min(max_copies, math.ceil(FLUSH_BYTES / w.nbytes)))
        self.ws = [w] + [w.clone() for _ in range(self.copies - 1)]
        self.nw = rand(k, scale=0.1) + 1 if prologue == "rmsnorm" else None  # [K]
        self.res = rand(m, n) if epilogue == "residual" else None  # [M, N]
        self.gated, self.bytes = epilogue == "gated", w.nbytes
        self.n_out = n // 2 if self.gated else n

    def args(self, i: int = 0) -> tuple:
        """The fused op's tensor arguments with weight copy i (what a compiled graph takes)."""
        return (self.x, self.nw, self.ws[i], self.res)

    def ref(self, i: int = 0) -> torch.Tensor:  # [M, N]
        return unfused(self.gated, *self.args(i))

    def ours(self, i: int = 0, config=None) -> torch.Tensor:  # [M, N]
        from kernels.skinny_gemm_triton import skinny_gemm_triton

        return skinny_gemm_triton(self.x, self.ws[i], norm_weight=self.nw, eps=EPS,
                                  gated=self.gated, residual=self.res, config=config)


def unfused(gated: bool, x: torch.Tensor, nw: torch.Tensor | None, w: torch.Tensor,
            res: torch.Tensor | None) -> torch.Tensor:  # [M, N]
    """The model's unfused ops (``kernels.skinny_gemm_ref``)."""
    from kernels.skinny_gemm_ref import gated_linear_ref, linear_ref, rmsnorm_linear_ref

    if gated:
        return gated_linear_ref(x, nw, EPS, w)
    if nw is not None:
        return rmsnorm_linear_ref(x, nw, EPS, w, res)
    return linear_ref(x, w, res)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def run(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    from kernels.gemm_config import candidates, gemm_config

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    dry = args.dry_run
    shapes, ms, max_copies = ({"tiny": (96, 40)}, (1, 5), 2) if dry else (MODELS[args.model],
                                                                         args.ms, 512)
    fused = [("rmsnorm+tiny", "tiny", "rmsnorm", None), ("rmsnorm+tiny+silu_mul", "tiny",
              "rmsnorm", "gated"), ("tiny+residual", "tiny", None, "residual")] if dry else FUSED
    notes, rows = [], []
    result = dict(device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)",
                  torch=torch.__version__, dtype="bfloat16", rows=rows, notes=notes)
    # One compiled graph per (shape, M) of the same lambda code: more than the default 8.
    torch._dynamo.config.recompile_limit = 1024

    def add(section: str, shape: str, m: int, variant: str, us: float, case: Case,
            err: float | None = None, **extra) -> None:
        rows.append(dict(section=section, shape=shape, M=m, K=shapes[shape][0],
                         N=shapes[shape][1], variant=variant, us=round(us, 3),
                         weight_gbps=round(case.bytes / us / 1e3, 1), err=err, **extra))

    if "linear" in args.sections:
        sec = Section("linear", args.limit_scale * LIMITS["linear"], notes)
        for m in ms:
            for name, (k, n) in shapes.items():
                if sec.over():
                    continue
                case = Case(k, n, m, None, None, dev, dtype, max_copies)
                add("linear", name, m, "cublas", time_us(lambda i: F.linear(case.x, case.ws[i]),
                                                         case.copies), case)
                pick = gemm_config(m, n, k)
                for cfg in candidates(m, n, k)[:2 if dry else None]:
                    err = rel_err(case.ours(0, cfg), case.ref())  # correctness before timing
                    us = time_us(lambda i: case.ours(i, cfg), case.copies)
                    add("linear", name, m, "ours", us, case, err, config=cfg.name,
                        picked=cfg == pick)
        save(result)
    if "inductor" in args.sections:
        sec = Section("inductor", args.limit_scale * LIMITS["inductor"], notes)
        mode = dict(backend="eager") if dry else dict(mode="max-autotune-no-cudagraphs")
        for m in ms:
            for name, (k, n) in shapes.items():
                if sec.over():
                    continue
                case = Case(k, n, m, None, None, dev, dtype, max_copies)
                lin = torch.compile(lambda x, w: F.linear(x, w), dynamic=False, **mode)
                t0 = time.perf_counter()
                err = rel_err(lin(case.x, case.ws[0]), case.ref())
                compile_s = round(time.perf_counter() - t0, 1)
                us = time_us(lambda i: lin(case.x, case.ws[i]), case.copies)
                add("inductor", name, m, "inductor max-autotune", us, case, err,
                    compile_s=compile_s)
        save(result)
    if "fused" in args.sections:
        sec = Section("fused", args.limit_scale * LIMITS["fused"], notes)
        for m in ms:
            for variant, name, prologue, epilogue in fused:
                if sec.over() or name not in shapes:
                    continue
                k, n = shapes[name]
                case = Case(k, n, m, prologue, epilogue, dev, dtype, max_copies)
                # Tensors as arguments (an int index would be a guard: one graph per copy).
                base = torch.compile(lambda x, nw, w, r, gt=case.gated: unfused(gt, x, nw, w, r),
                                     dynamic=False, **(dict(backend="eager") if dry else {}))
                add("fused", name, m, f"{variant} unfused (inductor + cublas)",
                    time_us(lambda i: base(*case.args(i)), case.copies), case,
                    rel_err(base(*case.args(0)), case.ref()))
                # Every candidate config, the pick first: the pick was chosen on plain GEMMs
                # (eleventh session), and a prologue changes what a program holds in registers.
                pick = gemm_config(m, case.n_out, k)
                cands = [c for c in candidates(m, case.n_out, k)
                         if not (case.gated and c.split_k > 1)]  # gating needs whole sums
                for cfg in cands[:2 if dry else None]:
                    err = rel_err(case.ours(0, cfg), case.ref())
                    add("fused", name, m, f"{variant} fused (ours)",
                        time_us(lambda i: case.ours(i, cfg), case.copies), case, err,
                        config=cfg.name, picked=cfg == pick)
        save(result)
    return result


def _best(rows: list[dict], **match) -> dict | None:
    hits = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    return min(hits, key=lambda r: r["us"]) if hits else None


def _us(r: dict | None) -> str:
    return "-" if r is None else f"{r['us']:.2f}"


def markdown(result: dict) -> str:
    rows = result["rows"]
    out = [f"# Skinny GEMM, {result['device']}, torch {result['torch']}, bf16, us per call "
           "(CUDA-graph replay, weights L2-cold)", "",
           "| shape | M | cuBLAS | ours (pick) | ours best | best config | inductor | "
           "pick vs cuBLAS | max err |", "|---|---|---|---|---|---|---|---|---|"]
    order = list(dict.fromkeys(r["shape"] for r in rows))  # as measured: the model's order
    keys = sorted({(r["shape"], r["M"]) for r in rows if r["section"] != "fused"},
                  key=lambda s: (order.index(s[0]), s[1]))
    for shape, m in keys:
        cub = _best(rows, section="linear", shape=shape, M=m, variant="cublas")
        pick = _best(rows, section="linear", shape=shape, M=m, variant="ours", picked=True)
        best = _best(rows, section="linear", shape=shape, M=m, variant="ours")
        ind = _best(rows, section="inductor", shape=shape, M=m)
        errs = [r["err"] for r in rows if r["shape"] == shape and r["M"] == m
                and r["err"] is not None]
        speed = f"{cub['us'] / pick['us']:.2f}x" if cub and pick else "-"
        cfg = best["config"] if best else "-"
        err = f"{max(errs):.1e}" if errs else "-"
        out.append(f"| {shape} | {m} | {_us(cub)} | {_us(pick)} | {_us(best)} | {cfg} | "
                   f"{_us(ind)} | {speed} | {err} |")
    fused = [r for r in rows if r["section"] == "fused"]
    if fused:
        out += ["", "| fusion | M | unfused | fused (ours, pick) | speed-up | fused best | "
                "best config | err |", "|---|---|---|---|---|---|---|---|"]
        for r in fused:
            if r["variant"].endswith("fused (ours)") and r.get("picked", True):
                v = r["variant"][: -len(" fused (ours)")]
                base = _best(fused, M=r["M"], variant=f"{v} unfused (inductor + cublas)")
                best = _best(fused, M=r["M"], variant=r["variant"])
                sp = f"{base['us'] / r['us']:.2f}x" if base else "-"
                out.append(f"| {v} | {r['M']} | {_us(base)} | {r['us']:.2f} | {sp} | "
                           f"{_us(best)} | {best['config']} | {r['err']:.1e} |")
    layer = []
    for m in sorted({r["M"] for r in rows}):
        cub = [_best(rows, section="linear", shape=s, M=m, variant="cublas") for s in LAYER_GEMMS]
        pick = [_best(rows, section="linear", shape=s, M=m, variant="ours", picked=True)
                for s in LAYER_GEMMS]
        if all(cub) and all(pick):
            layer.append(f"| {m} | {sum(r['us'] for r in cub):.2f} | "
                         f"{sum(r['us'] for r in pick):.2f} |")
    if layer:
        out += ["", "Per decoder layer, the 4 GEMMs (x30 layers per step):", "",
                "| M | cuBLAS | ours (pick) |", "|---|---|---|"] + layer
    out += [""] + [f"- note: {n}" for n in result["notes"]]
    return "\n".join(out) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON results path (markdown beside it)")
    p.add_argument("--sections", nargs="+", default=list(LIMITS), choices=list(LIMITS))
    p.add_argument("--ms", nargs="+", type=int, default=list(MS))
    p.add_argument("--model", default="smollm2", choices=list(MODELS),
                   help="whose GEMM shapes")
    p.add_argument("--limit-scale", type=float, default=1.0,
                   help="multiply every section's time limit")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shapes on the CPU under the Triton interpreter")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:  # before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print("bench_gemm needs a CUDA GPU (or --dry-run); none found, nothing to do.")
        return 0
    def save(result: dict) -> None:  # after each section: a killed run keeps what it measured
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(markdown(result))

    result = run(args, save)
    print(markdown(result))
    bad = [r for r in result["rows"] if r["err"] is not None and r["err"] > 3e-2]
    print("".join(f"ERROR too large: {r}\n" for r in bad), end="")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
