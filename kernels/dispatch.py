"""Which implementation an op takes for a tensor: Triton kernels on CUDA, the PyTorch reference
elsewhere (shared by ``kernels.ops`` and ``kernels.gemm_ops``)."""
from __future__ import annotations

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
