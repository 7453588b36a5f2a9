"""Programmatic dependent launch in our GEMM kernels (``COMPILED_SPEC_GEMM_PDL=1``): the path
only a Hopper GPU runs (griddepcontrol has no interpreter form), compiled here for sm_90 by
Triton's own pipeline down to PTX (no GPU needed): with GDC the skinny GEMM and the qkv + rope
kernel hold exactly one wait and one launch-dependents each, without it none; and the launch
option stays off for CPU tensors and split-K launches."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

_PTX = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.skinny_gemm_triton import _skinny_gemm_kernel
from kernels.qkv_rope_triton import _qkv_rope_kv_kernel

def count(k, consts):
    sig = {n: ("*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32")
           for n in k.arg_names}
    sig.update({c: "constexpr" for c in consts})
    src = ASTSource(k, sig, constexprs={(k.arg_names.index(c),): v for c, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
    return [ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")]

gemm = dict(NORM=False, NW_IN_A=False, GATED=True, HAS_RES=False, BLOCK_M=16, BLOCK_N=16,
            BLOCK_K=128, SPLIT_K=1, USE_DOT=True, DOT_FP32=False)
qkv = dict(HALF=32, NORM=False, NW_IN_A=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128,
           USE_DOT=True, DOT_FP32=False)
print(json.dumps({f"{name}{g}": count(k, dict(c, GDC=g)) for g in (0, 1)
                  for name, k, c in (("gemm", _skinny_gemm_kernel, gemm),
                                     ("qkv", _qkv_rope_kv_kernel, qkv))}))
"""


def test_gdc_path_compiles_for_hopper_with_one_wait_and_one_trigger() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _PTX], env=env, cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got == {"gemm0": [0, 0], "qkv0": [0, 0], "gemm1": [1, 1], "qkv1": [1, 1]}, got


def test_pdl_launch_option(monkeypatch) -> None:
    import kernels.skinny_gemm_triton as sg

    x = torch.zeros(2, 2)
    monkeypatch.setattr(sg, "PDL", False)
    assert sg.pdl_launch(x) == {"GDC": 0}
    monkeypatch.setattr(sg, "PDL", True)
    assert sg.pdl_launch(x) == {"GDC": 0}  # a CPU tensor: the interpreter has no griddepcontrol
    cuda_like = type("T", (), {"is_cuda": True})()
    assert sg.pdl_launch(cuda_like) == {"GDC": 1, "launch_pdl": True}
    assert sg.pdl_launch(cuda_like, allowed=False) == {"GDC": 0}  # split-K: reads x first
