"""Issue 16 (forty-eighth session): the 8B shape's fused qkv + rope + KV-write launch by config.

The forty-eighth session's 8B decode table put ``_qkv_rope_kv_kernel`` at 669.8 us per decode (32
calls, 20.9 us each) for 50.3 MB of weights a call: 2.4 TB/s, where the layer's other skinny
GEMMs read at 2.8 TB/s. Its pick (``qkv_config``) clamps the N tile to a half head (64 lanes), so
the launch has 48 programs (32 query + 16 kv heads) on 132 SMs. This sweeps N tile, K depth,
stages and warps at M = 1, 4, 8 (no norm: the engine's default 8B form keeps the RMSNorm
separate), checks every config against the pick's output, and prints us per call from
CUDA-graph replay with the weights L2-cold, beside cuBLAS and our plain GEMM at the same shape.

PYTHONPATH=. python profiles/scripts/qkv_sweep_h100.py --out $OUT/qkv_sweep.json
``--dry-run`` (CPU, TRITON_INTERPRET=1 set by the script): 2 query heads + 1 kv head of 128
by K = 256, three configs, wall clock; the script's sake only.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

if "--dry-run" in sys.argv:  # before Triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import torch.nn.functional as F

from kernels.gemm_config import GemmConfig, block_m_for, gemm_config
from kernels.graph_timer import graph_us
from kernels.qkv_rope_triton import qkv_config, qkv_rope_write_kv_triton
from kernels.skinny_gemm_triton import skinny_gemm_triton

D = 128  # head_dim
LLAMA8B = (32, 8, 4096)  # (query heads, kv heads, hidden)
DRY = (2, 1, 256)
EPS, FLUSH = 1e-5, 192 << 20


def configs(m: int, pick: GemmConfig) -> list[GemmConfig]:
    bm = block_m_for(m)
    out = [pick]
    out += [GemmConfig(bm, bn, bk, num_warps=w, num_stages=st)
            for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4, 5) for w in (4, 8)]
    if m == 1:  # CUDA-core FMA tiles, no padding of M to 16 rows
        out += [GemmConfig(1, bn, bk, use_dot=False, num_stages=st)
                for bn in (16, 32) for bk in (128, 256) for st in (3, 4)]
    seen: set[GemmConfig] = set()
    return [c for c in out if not (c in seen or seen.add(c))]


def wall_us(call, calls: int) -> float:
    """The dry run's stand-in for ``graph_us``: wall clock of one pass over the calls."""
    t = time.perf_counter()
    for i in range(calls):
        call(i)
    return (time.perf_counter() - t) * 1e6 / calls


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ms", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--limit", type=float, default=150.0)
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    t0, dev, dt = time.time(), "cuda", torch.bfloat16
    (H, KVH, HID), timer = LLAMA8B, graph_us
    if a.dry_run:
        (H, KVH, HID), timer = DRY, wall_us
        dev, dt, a.ms = "cpu", torch.float32, [1]
    g = torch.Generator(device="cpu").manual_seed(0)
    rows: list[dict] = []

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt)

    wq = rand((H + 2 * KVH) * D, HID, scale=HID ** -0.5)
    copies = 2 if a.dry_run else math.ceil(FLUSH / wq.nbytes)  # weights L2-cold on a GPU
    wqs = [wq] + [wq.clone() for _ in range(copies - 1)]
    kc, vc = rand(64, 16, KVH, D), rand(64, 16, KVH, D)
    nw = rand(HID, scale=0.1) + 1
    for m in a.ms:
        x = rand(m, HID)
        slots = torch.arange(m, device=dev, dtype=torch.int64) + 37
        ang = torch.rand(m, D // 2, generator=g).to(dev) * 6
        cos, sin = torch.cat((ang, ang), -1).cos().to(dt), torch.cat((ang, ang), -1).sin().to(dt)
        pick = qkv_config(m, wq.shape[0], HID, D // 2)
        want = qkv_rope_write_kv_triton(x, wq, kc, vc, slots, cos, sin, H, config=pick).float()

        def row(variant: str, us: float, err: float | None, cfg: GemmConfig | None) -> None:
            rows.append(dict(M=m, variant=variant, us=round(us, 3), err=err,
                             config=cfg.name if cfg else None,
                             tb_s=round(wq.nbytes / us / 1e6, 3)))
            print(f"M={m:<2d} {variant:14s} {us:7.2f} us {wq.nbytes / us / 1e6:5.2f} TB/s "
                  f"err {err}  {cfg.name if cfg else ''}", flush=True)

        row("cublas", timer(lambda i: F.linear(x, wqs[i]), copies), None, None)
        plain = gemm_config(m, wq.shape[0], HID)
        row("plain_pick", timer(lambda i: skinny_gemm_triton(x, wqs[i], config=plain),
                                   copies), None, plain)
        cands = configs(m, pick)
        for cfg in cands[:3 if a.dry_run else None]:
            if time.time() - t0 > a.limit:
                print("time limit: rest skipped", flush=True)
                break
            try:
                got = qkv_rope_write_kv_triton(x, wq, kc, vc, slots, cos, sin, H, config=cfg)
                err = ((got.float() - want).abs().max() / want.abs().max()).item()
                us = timer(lambda i: qkv_rope_write_kv_triton(
                    x, wqs[i], kc, vc, slots, cos, sin, H, config=cfg), copies)
            except Exception as e:  # a config past the SM's resources: recorded, not fatal
                print(f"M={m} {cfg.name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            row("pick" if cfg == pick else "qkv", us, round(err, 6), cfg)
        best = min((r for r in rows if r["M"] == m and r["variant"] in ("qkv", "pick")),
                   key=lambda r: r["us"], default=None)
        if best is not None:  # the norm-in-A form at the pick and the best config
            for name in {pick.name, best["config"]}:
                cfg = next(c for c in cands if c.name == name)
                us = timer(lambda i: qkv_rope_write_kv_triton(
                    x, wqs[i], kc, vc, slots, cos, sin, H, nw, EPS, config=cfg), copies)
                row("norm_in_a", us, None, cfg)
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "weights_mb": wq.nbytes / 1e6}, f, indent=1)
    for m in a.ms:
        ms = sorted((r for r in rows if r["M"] == m and r["variant"] in ("qkv", "pick")),
                    key=lambda r: r["us"])[:5]
        print(f"M={m} best: " + "; ".join(f"{r['config']} {r['us']}" for r in ms))


if __name__ == "__main__":
    main()
