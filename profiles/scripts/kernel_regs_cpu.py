"""Issue 16: registers, spills and load forms of our hot Triton binaries, compiled for sm_90 on
the CPU (no GPU needed).

Triton compiles a kernel down to PTX without a GPU (as tests/test_gemm_pdl.py does) and the
``ptxas`` that ships with it assembles the PTX with ``-v``: registers a thread, spill stores
and loads. Each binary is compiled as the engine's launch specialises it: pointers 16-byte
aligned (but those marked ``do_not_specialize_on_alignment``) and the integer arguments that
are multiples of 16 in the engine (``DIVISIBLE``) hinted as such. Without those hints the
binary is another one: scalar 2-byte loads, no cp.async pipelining and, for the 8B shape's
picks, 136-1,044 bytes of spills a thread, which the fiftieth session first took for the
engine's binaries. With them no pick spills (``results/2026-12-07_cpu_session50/``).

    python profiles/scripts/kernel_regs_cpu.py [--out F.json]

Rows: the paged attention for SmolLM2 (9 / 3 heads of 64) and the 8B shape (32 / 8 of 128),
bf16, the decode block (16 score rows) and a prefill block (64), 4 and 8 warps, the split path
with the merge kernel and with the fused merge; then the skinny GEMM's candidates
(``kernels.gemm_config.candidates``) for the 8B shape's o_proj, gate_up (gated, as the fused
layer runs it), down and lm_head at M = 1, the pick marked. Each row says whether the binary
loads through cp.async (a pipelined K loop) and how many 16-byte vector loads it issues.
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


# Integer arguments whose values are multiples of 16 in the engine (strides, head_dim, page
# size, GEMM N and K), which Triton's launch specialises as such (tt.divisibility 16), as it
# does every 16-byte-aligned pointer not marked do_not_specialize_on_alignment. Without these
# hints the binary differs from the engine's: scalar 2-byte loads instead of 16-byte vectors.
DIVISIBLE = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_cp",
             "stride_ch", "stride_ps", "stride_pt", "stride_ph", "stride_lt", "head_dim",
             "page_size", "N", "K", "stride_xm", "stride_wn", "stride_ym", "stride_rm"}


def ptx_of(consts: dict[str, Any], warps: int, kernel: Any = _paged_attn_kernel,
           stages: int = 3) -> str:
    k = kernel
    sig = {n: ("*fp32" if n in FP32 else "*i32" if n in INT else "*bf16" if n.endswith("_ptr")
               else "fp32" if n in ("qk_scale", "eps") else "i32") for n in k.arg_names}
    sig.update({c: "constexpr" for c in consts})
    unaligned = set(k.do_not_specialize_on_alignment or ())
    aligned = [i for i, n in enumerate(k.arg_names) if n not in consts and (
        n in DIVISIBLE or (n.endswith("_ptr") and n not in unaligned))]
    src = ASTSource(k, sig, constexprs={(k.arg_names.index(c),): v for c, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
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


def usage(info: str, ptx: str) -> dict[str, int]:
    """ptxas' registers and spill bytes (-1: not reported), the PTX's cp.async and 16-byte
    vector loads."""
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
    return {"registers": int(regs.group(1)) if regs else -1,
            "spill_stores": int(spill.group(1)) if spill else -1,
            "spill_loads": int(spill.group(2)) if spill else -1,
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "v4_loads": ptx.count("ld.global.v4")}


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
                for warps in (4, 8):
                    consts = dict(GROUP=group, GROUP_PAD=4, BLOCK_Q=block_q, BLOCK_N=64,
                                  DIM_PAD=dim, NUM_SPLITS=splits, DOT_FP32=False, TREE=False,
                                  FUSED_MERGE=fused,
                                  MERGE_CHUNK=merge_chunk_for(block_q * 4, dim, splits), GDC=0)
                    ptx = ptx_of(consts, warps)
                    exe = exe or ptxas_for(ptx)
                    if exe is None:
                        print("no bundled ptxas reads this Triton's PTX: nothing to report")
                        return
                    row = {"shape": name, "block_q": block_q, "splits": splits,
                           "fused_merge": fused, "warps": warps, **usage(_assemble(exe, ptx)
                                                                        or "", ptx)}
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
                   **usage(_assemble(exe, ptx) or "", ptx)}
            rows.append(row)
            print(json.dumps(row))
    print(f"triton {triton.__version__}, {os.path.basename(exe)}")
    if a.out:
        Path(a.out).write_text(json.dumps({"triton": triton.__version__, "rows": rows},
                                          indent=1))


if __name__ == "__main__":
    main()
