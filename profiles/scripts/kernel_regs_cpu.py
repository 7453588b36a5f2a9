"""Issue 16: registers and spills of the paged-attention and skinny-GEMM binaries, compiled for
sm_90 on the CPU.

Triton compiles the kernel down to PTX without a GPU (as tests/test_gemm_pdl.py does), and the
``ptxas`` that ships with Triton assembles it with ``-v``: registers per thread, spill stores
and loads, stack frame. A decode program is a short chain of dependent loads; one that spills
adds local-memory round trips to it. The fiftieth session found the 8B shape's decode binary at
255 registers and 200 bytes of spills at 4 warps (Triton's default), none at 8, and the 8B
shape's gated gate_up GEMM pick (n64 k256, 4 warps) at 960 bytes.

    python profiles/scripts/kernel_regs_cpu.py [--out F.json]

Rows: SmolLM2 (9 / 3 heads of 64) and the 8B shape (32 / 8 of 128), bf16, the decode block
(16 score rows) and a prefill block (64), 4 and 8 warps, 64- and 32-bit K / V offsets
(``COMPILED_SPEC_ATTN_OFF32``), the split path with the merge kernel and with the fused merge. Which PTX version the newest bundled ptxas reads decides which one
runs (``ptxas-blackwell`` where the plain one is older than Triton's PTX). Then the skinny
GEMM's candidates (``kernels.gemm_config.candidates``) for the 8B shape's layer GEMMs and lm_head
at M = 1, gated where the layer gates (gate_up), each marked where ``gemm_config`` picks it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels.attention_triton import _paged_attn_kernel  # noqa: E402
from kernels.gemm_config import candidates, gemm_config  # noqa: E402
from kernels.launch import merge_chunk_for  # noqa: E402
from kernels.skinny_gemm_triton import _skinny_gemm_kernel  # noqa: E402

FP32 = {"part_ptr", "lse_ptr"}
INT = {"counter_ptr", "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr",
       "tree_start_ptr", "tree_mask_ptr"}
SHAPES = {"smollm2": (3, 64), "llama8b": (4, 128)}  # (GQA group, head_dim)
# the 8B shape's GEMMs through the skinny kernel: (N, K, gated); qkv has its own kernel
GEMMS = {"o_proj": (4096, 4096, False), "gate_up": (14336, 4096, True),
         "down": (4096, 14336, False), "lm_head": (128256, 4096, False)}


def ptx_of(consts: dict[str, Any], warps: int, kernel: Any = _paged_attn_kernel,
           stages: int = 3) -> str:
    k = kernel
    sig = {n: ("*fp32" if n in FP32 else "*i32" if n in INT else "*bf16" if n.endswith("_ptr")
               else "fp32" if n == "qk_scale" else "i32") for n in k.arg_names}
    sig.update({c: "constexpr" for c in consts})
    src = ASTSource(k, sig, constexprs={(k.arg_names.index(c),): v for c, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages}).asm["ptx"]


def ptxas_for(ptx: str) -> str | None:
    """The first bundled ptxas that reads this PTX's version (None: none does)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas", "ptxas-blackwell"):
        exe = bin_dir / name
        if exe.exists() and _assemble(str(exe), ptx) is not None:
            return str(exe)
    return None


def _assemble(exe: str, ptx: str) -> str | None:
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        Path(src).write_text(ptx)
        r = subprocess.run([exe, "-v", "--gpu-name", "sm_90a", src, "-o",
                            os.path.join(d, "k.cubin")], capture_output=True, text=True)
        return r.stderr if r.returncode == 0 else None


def usage(info: str) -> dict[str, int]:
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"registers": int(regs.group(1)) if regs else -1,
            "spill_stores": int(spill.group(1)) if spill else -1,
            "spill_loads": int(spill.group(2)) if spill else -1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows, exe = [], None
    for name, (group, dim) in SHAPES.items():
        for block_q in (4, 16):  # decode / verify (16 score rows), a prefill block (64)
            for splits, fused in ((1, False), (8, False), (8, True), (32, True)):
                if block_q == 16 and splits > 1 and fused:
                    continue
                for warps, off64 in ((4, True), (8, True), (4, False)):
                    consts = dict(GROUP=group, GROUP_PAD=4, BLOCK_Q=block_q, BLOCK_N=64,
                                  DIM_PAD=dim, NUM_SPLITS=splits, DOT_FP32=False, TREE=False,
                                  FUSED_MERGE=fused,
                                  MERGE_CHUNK=merge_chunk_for(block_q * 4, dim, splits),
                                  GDC=0, OFF64=off64)
                    ptx = ptx_of(consts, warps)
                    exe = exe or ptxas_for(ptx)
                    if exe is None:
                        print("no bundled ptxas reads this Triton's PTX: nothing to report")
                        return
                    row = {"shape": name, "block_q": block_q, "splits": splits,
                           "fused_merge": fused, "warps": warps, "off64": off64,
                           **usage(_assemble(exe, ptx) or "")}
                    rows.append(row)
                    print(json.dumps(row))
    for name, (n, k, gated) in GEMMS.items():
        pick = gemm_config(1, n, k)
        for cfg in candidates(1, n, k):
            if not cfg.use_dot or cfg.split_k > 1:
                continue
            consts = dict(NORM=False, NW_IN_A=False, GATED=gated, HAS_RES=not gated,
                          BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                          SPLIT_K=1, USE_DOT=True, DOT_FP32=False, GDC=0, LATE=False)
            ptx = ptx_of(consts, cfg.num_warps, _skinny_gemm_kernel, cfg.num_stages)
            row = {"gemm": name, "config": cfg.name, "picked": cfg == pick,
                   **usage(_assemble(exe, ptx) or "")}
            rows.append(row)
            print(json.dumps(row))
    print(f"triton {triton.__version__}, {os.path.basename(exe)}")
    if a.out:
        Path(a.out).write_text(json.dumps({"triton": triton.__version__, "rows": rows},
                                          indent=1))


if __name__ == "__main__":
    main()
