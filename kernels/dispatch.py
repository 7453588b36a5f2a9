"""Which implementation an op takes for a tensor: Triton kernels on CUDA, the PyTorch reference
elsewhere (shared by ``kernels.ops`` and ``kernels.gemm_ops``); and how our kernels launch."""
from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar

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


# Programmatic dependent launch for our kernels of the decoder layer (the skinny GEMMs, qkv +
# rope + KV write, attention and its split merge): each lets the next launch as soon as it has
# waited for the one before (griddepcontrol), and a GEMM fetches its first weights before that
# wait. On inside ``pdl_scope(True)``, which an engine with ``CompileConfig.pdl`` (Inductor's
# kernels on PDL too) holds around its compiled calls, so a capture records it into the graph;
# COMPILED_SPEC_GEMM_PDL=1 turns it on for every engine of the process. With both halves a
# layer's whole chain overlaps launch and weight latency: on the H200 (thirtieth session)
# SmolLM2's fused decode call went from 0.884 to 0.775 ms, vanilla batch 1 from 0.98 to 0.78
# ms/token. Only launches of up to PDL_MAX_ROWS rows: EAGLE-3's 96-row verify (batch 16) was
# slower with it (1.46-1.60 vs 1.27 ms); likely (not yet profiled) early-launched programs
# holding SM slots that the wider GEMM before them still needed.
ENV_PDL = os.environ.get("COMPILED_SPEC_GEMM_PDL", "0") == "1"
PDL_MAX_ROWS = 64
_PDL: ContextVar[bool] = ContextVar("compiled_spec_pdl", default=ENV_PDL)


@contextmanager
def _scoped(var: ContextVar[bool], on: bool) -> Iterator[None]:
    token = var.set(on)
    try:
        yield
    finally:
        var.reset(token)


def pdl_scope(on: bool) -> AbstractContextManager[None]:
    """Our kernels launch with PDL inside (or always, under COMPILED_SPEC_GEMM_PDL=1)."""
    return _scoped(_PDL, on or ENV_PDL)


# PDL for the attention kernel and its split merge alone, in engines whose other kernels launch
# without it (the 8B shape: its GEMMs lost with PDL, pdl_policy.py). Those two are small grids
# after a GEMM, so their programs resident early take no SMs a wave still needs; the attention's
# launch overlaps the fused qkv kernel's tail (that kernel lets it launch once its K loop is done,
# ``late_trigger``), the merge's the attention's. On inside ``pdl_attention_scope(True)``;
# COMPILED_SPEC_PDL_ATTN=1 turns it on for every engine of the process.
ENV_PDL_ATTN = os.environ.get("COMPILED_SPEC_PDL_ATTN", "0") == "1"
_PDL_ATTN: ContextVar[bool] = ContextVar("compiled_spec_pdl_attn", default=ENV_PDL_ATTN)


def pdl_attention_scope(on: bool) -> AbstractContextManager[None]:
    return _scoped(_PDL_ATTN, on or ENV_PDL_ATTN)


# The skinny-GEMM ops past MAX_M rows (kernels.gemm_config.WIDE_MAX_M, tiles of MAX_M): on
# inside ``skinny_wide_scope(True)``, which an engine with ``CompileConfig.skinny_gemm_wide``
# holds around its compiled calls (and so its captures); COMPILED_SPEC_SKINNY_WIDE=1 turns it on
# for every engine of the process. Off by default until timed on a GPU.
ENV_SKINNY_WIDE = os.environ.get("COMPILED_SPEC_SKINNY_WIDE", "0") == "1"
_WIDE: ContextVar[bool] = ContextVar("compiled_spec_skinny_wide", default=ENV_SKINNY_WIDE)


def skinny_wide_scope(on: bool) -> AbstractContextManager[None]:
    return _scoped(_WIDE, on or ENV_SKINNY_WIDE)


def skinny_max_rows() -> int:
    """Rows the skinny-GEMM ops take through their Triton kernels in this scope."""
    from kernels.gemm_config import MAX_M, WIDE_MAX_M

    return WIDE_MAX_M if _WIDE.get() else MAX_M


def _narrow_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda and x.shape[0] <= PDL_MAX_ROWS


def pdl_launch(x: torch.Tensor, allowed: bool = True, attention: bool = False) -> dict:
    """A launch's GDC constexpr and, when on, Triton's PDL launch option (CUDA only: the
    interpreter has no griddepcontrol). ``x``: the launch's activations, rows first;
    ``attention``: the attention kernel or its merge (on in ``pdl_attention_scope`` too)."""
    on = (_PDL.get() or (attention and _PDL_ATTN.get())) and allowed and _narrow_cuda(x)
    return {"GDC": 1, "launch_pdl": True} if on else {"GDC": 0}


def late_trigger(x: torch.Tensor) -> bool:
    """Whether a GEMM kernel lets the kernel after it launch once its K loop is done rather
    than at its start: in ``pdl_attention_scope`` without engine-wide PDL, so the attention
    launched with PDL after the fused qkv + rope + KV write does not sit on SMs through its K
    loop. (Every GEMM triggering late under engine-wide PDL measured slower on the 8B shape,
    H100, forty-eighth session: decode with lm_head 6.054 against 5.947 ms without PDL.)"""
    if not _narrow_cuda(x):
        return False
    return not _PDL.get() and _PDL_ATTN.get()
