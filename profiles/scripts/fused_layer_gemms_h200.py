"""Issue 16 (twenty-ninth session): the decoder layer's fused launches at decode sizes against the
unfused kernels the engine runs today, us per call from CUDA-graph replay, weights L2-cold.

Rows (M = 1 and 6, bf16, SmolLM2's shapes, our kernels at gemm_config's pick, at BLOCK_K 64,
and for M <= 8 with CUDA-core FMA tiles instead of tl.dot):
  qkv:      unfused = [Inductor RMSNorm] + cuBLAS + rope_write_kv kernel; fused = qkv_rope
            with the norm weight in A, in W (pre-scaled columns), or without a norm
  gate_up:  unfused = [Inductor RMSNorm] + cuBLAS + Inductor SiLU-and-mul; fused = gated GEMM,
            same three norm forms
  plain:    cuBLAS vs our plain GEMM (qkv and gate_up shapes), the yardstick for the fusions
Every fused result is checked against its unfused reference first (max |err| / max |ref|).

PYTHONPATH=. python profiles/scripts/fused_layer_gemms_h200.py --out $OUT/fused_layer.json
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from kernels.gemm_config import GemmConfig, block_m_for, gemm_config
from kernels.graph_timer import graph_us
from kernels.qkv_rope_triton import qkv_config, qkv_rope_write_kv_triton
from kernels.rope_kv_triton import rope_write_kv_triton
from kernels.skinny_gemm_ref import rms_norm_ref, silu_mul_ref
from kernels.skinny_gemm_triton import skinny_gemm_triton

H, KVH, D, HID, INTER = 9, 3, 64, 576, 1536  # SmolLM2-135M
EPS, FLUSH = 1e-5, 192 << 20


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ms", nargs="+", type=int, default=[1, 6])
    p.add_argument("--limit", type=float, default=240.0)
    a = p.parse_args()
    t0, dev, dt = time.time(), "cuda", torch.bfloat16
    rows: list[dict] = []
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt)

    def row(kind: str, m: int, variant: str, fn, copies: int, err: float | None = None,
            cfg: GemmConfig | None = None) -> None:
        us = graph_us(fn, copies)
        rows.append(dict(kind=kind, M=m, variant=variant, us=round(us, 3), err=err,
                         config=cfg.name if cfg else None))
        print(f"{kind:8s} M={m:<3d} {variant:44s} {us:7.2f} us  err {err}"
              + (f"  {cfg.name}" if cfg else ""), flush=True)

    norm_c = torch.compile(lambda x, nw: rms_norm_ref(x, nw, EPS), dynamic=False)
    gate_c = torch.compile(lambda gu: silu_mul_ref(gu), dynamic=False)
    for m in a.ms:
        if time.time() - t0 > a.limit:
            print("time limit: rest skipped", flush=True)
            break
        x, nw = rand(m, HID), rand(HID, scale=0.1) + 1
        # --- qkv + rope + KV write ---
        wq = rand((H + 2 * KVH) * D, HID, scale=HID ** -0.5)
        copies = math.ceil(FLUSH / wq.nbytes)
        wqs = [wq] + [wq.clone() for _ in range(copies - 1)]
        wqs_n = [w * nw[None, :] for w in wqs]  # norm weight folded into the columns
        kc, vc = rand(64, 16, KVH, D), rand(64, 16, KVH, D)
        slots = torch.arange(m, device=dev, dtype=torch.int64) + 37
        ang = torch.rand(m, D // 2, generator=g).to(dev) * 6
        cos, sin = torch.cat((ang, ang), -1).cos().to(dt), torch.cat((ang, ang), -1).sin().to(dt)

        def unfused_qkv(i: int, norm: bool = True) -> torch.Tensor:
            h = norm_c(x, nw) if norm else x
            qkv = F.linear(h, wqs[i]).view(m, H + 2 * KVH, D)
            return rope_write_kv_triton(qkv[:, :H + KVH], qkv[:, H + KVH:], kc, vc, slots, cos,
                                        sin, H)

        want, want_plain = unfused_qkv(0), unfused_qkv(0, False)
        row("qkv", m, "unfused: norm + cuBLAS + rope_kv", unfused_qkv, copies, 0.0)
        row("qkv", m, "unfused, no norm: cuBLAS + rope_kv", lambda i: unfused_qkv(i, False),
            copies, 0.0)
        row("qkv", m, "cuBLAS alone", lambda i: F.linear(x, wqs[i]), copies)
        pick = qkv_config(m, wq.shape[0], HID, D // 2)
        qkv_cfgs = [pick, GemmConfig(pick.block_m, pick.block_n, 64, num_stages=3)]
        if m <= 8:  # CUDA-core FMA tiles: 8-lane halves, 60 programs instead of 30
            qkv_cfgs += [GemmConfig(block_m_for(m, False), 8, bk, use_dot=False)
                         for bk in (64, 128)]
        for cfg in qkv_cfgs:
            e = rel(qkv_rope_write_kv_triton(x, wq, kc, vc, slots, cos, sin, H, nw, EPS,
                                             config=cfg), want)
            row("qkv", m, "fused: norm (w in A) + qkv + rope_kv",
                lambda i: qkv_rope_write_kv_triton(x, wqs[i], kc, vc, slots, cos, sin, H, nw,
                                                   EPS, config=cfg), copies, e, cfg)
            e = rel(qkv_rope_write_kv_triton(x, wqs_n[0], kc, vc, slots, cos, sin, H, None, EPS,
                                             config=cfg, norm_in_weight=True), want)
            row("qkv", m, "fused: norm (w in W) + qkv + rope_kv",
                lambda i: qkv_rope_write_kv_triton(x, wqs_n[i], kc, vc, slots, cos, sin, H,
                                                   None, EPS, config=cfg, norm_in_weight=True),
                copies, e, cfg)
            e = rel(qkv_rope_write_kv_triton(x, wq, kc, vc, slots, cos, sin, H, config=cfg),
                    want_plain)
            row("qkv", m, "fused, no norm: qkv + rope_kv",
                lambda i: qkv_rope_write_kv_triton(x, wqs[i], kc, vc, slots, cos, sin, H,
                                                   config=cfg), copies, e, cfg)
            row("qkv", m, "ours plain GEMM",
                lambda i: skinny_gemm_triton(x, wqs[i], config=cfg), copies, None, cfg)
        del wqs, wqs_n
        # --- gate_up + SiLU-and-mul ---
        wg = rand(2 * INTER, HID, scale=HID ** -0.5)
        copies = math.ceil(FLUSH / wg.nbytes)
        wgs = [wg] + [wg.clone() for _ in range(copies - 1)]
        wgs_n = [w * nw[None, :] for w in wgs]
        want = gate_c(F.linear(norm_c(x, nw), wg))
        row("gate_up", m, "unfused: norm + cuBLAS + silu_mul",
            lambda i: gate_c(F.linear(norm_c(x, nw), wgs[i])), copies, 0.0)
        row("gate_up", m, "unfused, no norm: cuBLAS + silu_mul",
            lambda i: gate_c(F.linear(x, wgs[i])), copies, 0.0)
        row("gate_up", m, "cuBLAS alone", lambda i: F.linear(x, wgs[i]), copies)
        pick = gemm_config(m, INTER, HID)
        gate_cfgs = [pick, GemmConfig(pick.block_m, pick.block_n, 64, num_stages=3),
                     GemmConfig(pick.block_m, 32, 64, num_stages=3)]
        if m <= 8:
            gate_cfgs += [GemmConfig(block_m_for(m, False), bn, 64, use_dot=False)
                          for bn in (8, 16)]
        for cfg in gate_cfgs:
            e = rel(skinny_gemm_triton(x, wg, norm_weight=nw, eps=EPS, gated=True, config=cfg),
                    want)
            row("gate_up", m, "fused: norm (w in A) + gate_up + silu_mul",
                lambda i: skinny_gemm_triton(x, wgs[i], norm_weight=nw, eps=EPS, gated=True,
                                             config=cfg), copies, e, cfg)
            e = rel(skinny_gemm_triton(x, wgs_n[0], eps=EPS, gated=True, config=cfg,
                                       norm_in_weight=True), want)
            row("gate_up", m, "fused: norm (w in W) + gate_up + silu_mul",
                lambda i: skinny_gemm_triton(x, wgs_n[i], eps=EPS, gated=True, config=cfg,
                                             norm_in_weight=True), copies, e, cfg)
            e = rel(skinny_gemm_triton(x, wg, gated=True, config=cfg), gate_c(F.linear(x, wg)))
            row("gate_up", m, "fused, no norm: gate_up + silu_mul",
                lambda i: skinny_gemm_triton(x, wgs[i], gated=True, config=cfg), copies, e, cfg)
            row("gate_up", m, "ours plain GEMM (2I columns)",
                lambda i: skinny_gemm_triton(x, wgs[i], config=cfg), copies, None, cfg)
        del wgs, wgs_n
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
