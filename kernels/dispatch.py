"""Which implementation an op takes for a tensor: Triton kernels on CUDA, the PyTorch reference
elsewhere (shared by ``kernels.ops`` and ``kernels.gemm_ops``); and how our kernels launch."""
from __future__ import annotations

import os

import torch

from kernels import warmup_pending


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda


def attention_triton(t: torch.Tensor) -> bool:
    """``use_triton`` for the attention family, whose binaries a cold start may still be
    compiling in worker processes: the first launch joins them (``kernels.warmup_pending``)."""
    if not t.is_cuda:
        return False
    if warmup_pending.PENDING:
        warmup_pending.finish()
    return True


# COMPILED_SPEC_GEMM_PDL=1: our kernels of the decoder layer (the skinny GEMMs, qkv + rope + KV
# write, attention and its split merge) launch with programmatic dependent launch: each lets
# the next launch as soon as it has waited for the one before (griddepcontrol), and a GEMM
# fetches its first weights before that wait. With Inductor's kernels on PDL as well
# (``CompileConfig.pdl``) a layer's whole chain overlaps launch and weight latency. Off until
# timed on the H200 (a kernel that never triggers its dependents early, cuBLAS's, leaves the
# next nothing to overlap).
PDL = os.environ.get("COMPILED_SPEC_GEMM_PDL", "0") == "1"


def pdl_launch(x: torch.Tensor, allowed: bool = True) -> dict:
    """A launch's GDC constexpr and, when on, Triton's PDL launch option (CUDA only: the
    interpreter has no griddepcontrol)."""
    on = PDL and allowed and x.is_cuda
    return {"GDC": 1, "launch_pdl": True} if on else {"GDC": 0}
