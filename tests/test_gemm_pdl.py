"""Programmatic dependent launch in our decoder-layer kernels (``CompileConfig.pdl``): the
path only a Hopper GPU runs (griddepcontrol has no interpreter form), compiled here for sm_90 by
Triton's own pipeline down to PTX (no GPU needed): with GDC the skinny GEMM, the qkv + rope
kernel, attention and the split merge hold exactly one wait and one launch-dependents each,
without it none; and the launch option: on only inside an engine's PDL scope (its compiled
calls, captures included), never for CPU tensors, split-K launches or more than 64 rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

_PTX = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels.attention_merge_triton import _merge_splits_kernel
from kernels.attention_triton import _paged_attn_kernel
from kernels.skinny_gemm_triton import _skinny_gemm_kernel
from kernels.qkv_rope_triton import _qkv_rope_kv_kernel
FP32 = {"part_ptr", "lse_ptr"}
INT = {"counter_ptr", "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr",
       "tree_start_ptr", "tree_mask_ptr", "slot_ptr"}

def count(k, consts):
    sig = {n: ("*fp32" if n in FP32 else "*i32" if n in INT else "*bf16" if n.endswith("_ptr")
               else "fp32" if n in ("eps", "qk_scale") else "i32") for n in k.arg_names}
    sig.update({c: "constexpr" for c in consts})
    src = ASTSource(k, sig, constexprs={(k.arg_names.index(c),): v for c, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4, "num_stages": 4}).asm["ptx"]
    return [ptx.count("griddepcontrol.wait"), ptx.count("griddepcontrol.launch_dependents")]

gemm = dict(NORM=False, NW_IN_A=False, GATED=True, HAS_RES=False, BLOCK_M=16, BLOCK_N=16,
            BLOCK_K=128, SPLIT_K=1, USE_DOT=True, DOT_FP32=False, LATE=False)
qkv = dict(HALF=32, NORM=False, NW_IN_A=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=128,
           USE_DOT=True, DOT_FP32=False, LATE=False)
attn = dict(GROUP=3, GROUP_PAD=4, BLOCK_Q=4, BLOCK_N=64, DIM_PAD=64, NUM_SPLITS=32,
            DOT_FP32=False, TREE=False, FUSED_MERGE=False, MERGE_CHUNK=1)
merge = dict(NUM_SPLITS=32, DIM_PAD=64)
print(json.dumps({f"{name}{g}": count(k, dict(c, GDC=g)) for g in (0, 1)
                  for name, k, c in (("gemm", _skinny_gemm_kernel, gemm),
                                     ("qkv", _qkv_rope_kv_kernel, qkv),
                                     ("attn", _paged_attn_kernel, attn),
                                     ("merge", _merge_splits_kernel, merge))}
                 | {f"{name}late{g}": count(k, dict(c, GDC=g, LATE=True)) for g in (0, 1)
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
    # LATE: one launch-dependents, after the K loop (the wait only where launched with PDL)
    assert got == {f"{k}{g}": [g, g] for k in ("gemm", "qkv", "attn", "merge")
                   for g in (0, 1)} | {f"{k}late{g}": [g, 1] for k in ("gemm", "qkv")
                                       for g in (0, 1)}, got


def test_pdl_launch_option() -> None:
    import kernels.dispatch as sg

    def cuda_like(rows: int) -> object:
        return type("T", (), {"is_cuda": True, "shape": (rows, 576)})()

    assert not sg.ENV_PDL  # CI runs without COMPILED_SPEC_GEMM_PDL
    assert sg.pdl_launch(cuda_like(1)) == {"GDC": 0}  # off outside an engine's PDL scope
    with sg.pdl_scope(True):
        # a CPU tensor: the interpreter has no griddepcontrol
        assert sg.pdl_launch(torch.zeros(2, 2)) == {"GDC": 0}
        assert sg.pdl_launch(cuda_like(1)) == {"GDC": 1, "launch_pdl": True}
        assert sg.pdl_launch(cuda_like(sg.PDL_MAX_ROWS)) == {"GDC": 1, "launch_pdl": True}
        assert sg.pdl_launch(cuda_like(1), allowed=False) == {"GDC": 0}  # split-K: reads x first
        # a wide launch (EAGLE-3's 96-row verify at batch 16) measured slower with PDL
        assert sg.pdl_launch(cuda_like(sg.PDL_MAX_ROWS + 32)) == {"GDC": 0}
        with sg.pdl_scope(False):
            assert sg.pdl_launch(cuda_like(1)) == {"GDC": 0}
        assert sg.pdl_launch(cuda_like(1)) == {"GDC": 1, "launch_pdl": True}
    assert sg.pdl_launch(cuda_like(1)) == {"GDC": 0}


def test_attention_only_pdl() -> None:
    """``pdl_attention_scope``: the attention and its merge launch with PDL, nothing else does,
    and the kernel before them triggers late; under the engine-wide scope, no late trigger."""
    import kernels.dispatch as sg

    def cuda_like(rows: int) -> object:
        return type("T", (), {"is_cuda": True, "shape": (rows, 576)})()

    assert not sg.ENV_PDL_ATTN
    assert not sg.late_trigger(cuda_like(1))
    with sg.pdl_attention_scope(True):
        assert sg.pdl_launch(cuda_like(1), attention=True) == {"GDC": 1, "launch_pdl": True}
        assert sg.pdl_launch(cuda_like(1)) == {"GDC": 0}  # a GEMM stays off
        assert sg.late_trigger(cuda_like(1))
        assert not sg.late_trigger(torch.zeros(1, 2))  # the interpreter: no griddepcontrol
        assert sg.pdl_launch(cuda_like(sg.PDL_MAX_ROWS + 1), attention=True) == {"GDC": 0}
        assert not sg.late_trigger(cuda_like(sg.PDL_MAX_ROWS + 1))
        with sg.pdl_scope(True):  # engine-wide PDL: kernels trigger at their start
            assert not sg.late_trigger(cuda_like(1))
            assert sg.pdl_launch(cuda_like(1)) == {"GDC": 1, "launch_pdl": True}
    assert sg.pdl_launch(cuda_like(1), attention=True) == {"GDC": 0}


_SEEN: list[bool] = []
_ROWS: list[int] = []


@torch.library.custom_op("cs_test::pdl_probe", mutates_args=())
def _pdl_probe(x: torch.Tensor) -> torch.Tensor:
    import kernels.dispatch as sg

    _SEEN.append(sg._PDL.get())  # what our ops' launches would read at run time
    _ROWS.append(sg.skinny_max_rows())  # and the rows the skinny-GEMM ops would take
    return x.clone()


@_pdl_probe.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _Probe(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.cs_test.pdl_probe(x) + 1


def _probe_call(cfg):  # noqa: ANN001, ANN202 - a CompileConfig; the compiled probe
    """The probe compiled as an engine's callable under ``cfg`` (its own scopes), records
    cleared."""
    from compiled_spec.compile import compile_callable

    def backend(gm, example_inputs):  # noqa: ANN001
        return gm.forward

    backend.uuid = lambda: "probe"  # type: ignore[attr-defined]
    _SEEN.clear()
    _ROWS.clear()
    torch._dynamo.reset()
    return compile_callable(_Probe(), backend, cfg)


def test_engine_config_scopes_our_pdl_to_its_compiled_calls() -> None:
    """``CompileConfig.pdl`` puts our kernels on PDL for the engine's own compiled calls (and so
    its captures), not process-wide: another engine in the process (``--ab pdl``'s "off") and
    code outside the calls launch without it."""
    from compiled_spec.compile import CompileConfig

    x = torch.zeros(3)
    for pdl in (True, False):
        call = _probe_call(CompileConfig(pdl=pdl))
        assert torch.equal(call(x), x + 1) and torch.equal(call(x), x + 1)
        assert _SEEN and set(_SEEN) == {pdl}, (pdl, _SEEN)
    import kernels.dispatch as sg

    assert sg._PDL.get() is False


def test_engine_config_scopes_wide_skinny_gemms_to_its_compiled_calls() -> None:
    """``CompileConfig.skinny_gemm_wide`` lets the skinny-GEMM ops take up to WIDE_MAX_M rows in
    the engine's own compiled calls (and captures), not process-wide (``--ab skinny_gemm_wide``
    builds both engines in one process)."""
    from compiled_spec.compile import CompileConfig
    from kernels.dispatch import skinny_max_rows
    from kernels.gemm_config import MAX_M, WIDE_MAX_M

    x = torch.zeros(3)
    for wide in (True, False):
        call = _probe_call(CompileConfig(skinny_gemm_wide=wide))
        assert torch.equal(call(x), x + 1)
        assert _ROWS and set(_ROWS) == {WIDE_MAX_M if wide else MAX_M}, (wide, _ROWS)
    assert skinny_max_rows() == MAX_M
    with pytest.raises(ValueError, match="skinny_gemm_wide=True needs skinny_gemm"):
        CompileConfig(skinny_gemm_wide=True, skinny_gemm=False)
