"""Whether an engine's target runs our skinny GEMMs (passes/skinny_gemm.py) when its
``CompileConfig`` leaves it to us (``skinny_gemm=None``, the default).

Measured:
- SmolLM2-135M (largest layer weight 3072 x 576 = 1.8M elements), bf16, H200 (thirtieth
  session, profiles/results/2026-12-04_h200_session30/): every bench row gained with the GEMMs
  and the layer fusions: vanilla batch 4 / 16 by 7.5 / 5.2% (batch 1 by 8.8% and 64 by 4.7% in
  the twenty-ninth session), EAGLE-3 batch 4 / 16 by 14 / 7.4%; a verify of 96 rows (beyond
  the kernels' 64, so cuBLAS with the residual in its epilogue) ties.
- The Llama-3.1-8B shape (weights of 16.8M-117M elements), bf16, H100 (forty-fifth session,
  profiles/results/2026-12-06_h100_session45/): with the deep-K tiles of
  ``kernels.gemm_config`` each layer GEMM beats cuBLAS (1.01-1.06x) and the fused layer
  without PDL takes the decode call with lm_head from 6.267 to 5.963 ms (1.20x -> 1.14x its
  floor), verify T = 8 from 6.458 to 6.100. (With the earlier 64-deep tiles it was slower:
  5.47 vs 4.76 ms on the H200.) PDL on that layer loses (6.807 ms): ``pdl_policy``.
- fp32: slower (3.33 vs 1.17 ms per SmolLM2 token): the kernels are tuned for 16-bit tiles.
So the default is on for CUDA and 16-bit dtypes.

The lm_head (``CompileConfig.skinny_gemm_readout``; never for a sharded model) goes with the
layers where it is large: the 8B shape's (525M elements), M = 1 / 16, took 345.7 / 354.0 us
against cuBLAS's 373.0 / 378.1 (H100, forty-sixth session, ``kernels.bench_gemm --model
llama8b``), and its decode call with it ran at 1.124x its floor, the lm_head adding 0.334 ms to
the call where cuBLAS's added 0.395 (two H100s of that model, not one A/B). SmolLM2's (28M
elements; 15.86 against 16.42 us per GEMM on the H200, eleventh session) is not timed end to
end with it, so it stays cuBLAS's below ``READOUT_MIN_WEIGHT``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AUTO_DTYPES = (torch.bfloat16, torch.float16)
READOUT_MIN_WEIGHT = 100_000_000  # lm_head elements from which it is ours by default


@dataclass(frozen=True)
class SkinnyChoice:
    gemm: bool  # residual adds into our skinny GEMMs
    layer: bool  # with gemm: SiLU-and-mul and rope + KV write too
    why: str  # what decided it (engine stats)
    readout: bool = False  # with gemm: the lm_head too (``CausalLM.readout``; not sharded)


def largest_layer_weight(model: torch.nn.Module) -> int:
    """Elements of the largest 2-D weight of a Linear in the model (lm_head excluded: it runs
    outside the compiled graph); 0 when there is none."""
    sizes = [m.weight.numel() for name, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")]
    return max(sizes, default=0)


def skinny_auto(device_type: str, dtype: torch.dtype, largest_weight: int) -> tuple[bool, str]:
    """The default for one target: (on, why)."""
    if device_type != "cuda":
        return False, f"auto: off on {device_type} (Triton GEMMs for CUDA)"
    if dtype not in AUTO_DTYPES:
        return False, f"auto: off for {dtype} (tuned for 16-bit tiles; fp32 measured slower)"
    if largest_weight <= 0:
        return False, "auto: off, no Linear layer to size (not our decoder's layout)"
    return True, f"auto: on ({dtype} on CUDA, largest layer weight {largest_weight} elements)"


def resolve_skinny(gemm: bool | None, layer: bool | None, model: torch.nn.Module,
                   readout: bool | None = None) -> SkinnyChoice:
    """``CompileConfig.skinny_gemm`` / ``skinny_gemm_layer`` / ``skinny_gemm_readout`` with None
    resolved for ``model``: the GEMMs by ``skinny_auto``, the layer fusions as the GEMMs go, the
    lm_head with them from ``READOUT_MIN_WEIGHT`` elements (only for a model with
    ``CausalLM.readout``, not sharded)."""
    if gemm is None:
        param = next(model.parameters(), None)
        if param is None:
            gemm, why = False, "auto: off, the model has no parameters"
        else:
            gemm, why = skinny_auto(param.device.type, param.dtype, largest_layer_weight(model))
    else:
        why = f"set: skinny_gemm={gemm}"
    if readout is None:
        head = getattr(getattr(model, "lm_head", None), "weight", None)
        readout = head is not None and head.numel() >= READOUT_MIN_WEIGHT
    readout = readout and gemm and getattr(model, "tp", None) is None \
        and hasattr(model, "skinny_readout")
    return SkinnyChoice(gemm, gemm if layer is None else (layer and gemm), why, readout)
