"""Whether an engine's kernels use programmatic dependent launch (PDL) when its
``CompileConfig`` leaves it to us (``pdl=None``, the default): Inductor's Triton kernels
(compiled with it) and ours (``kernels/dispatch.py``, launches of up to ``PDL_MAX_ROWS`` rows).

Measured on the H200 (thirtieth session, profiles/results/2026-12-04_h200_session30/), SmolLM2
with the fused layer (``gemm_policy.py``), bf16:
- the decode call at T = 1 / 4 / 8 rows: 0.884 / 0.896 / 0.921 -> 0.775 / 0.795 / 0.827 ms;
  vanilla batch 1 end to end 0.777 ms/token; vanilla batch 16 16,083.7 tok/s (14,701.7 without);
- EAGLE-3 at batch 16, whose verify is 96 rows: 1.602 ms per verify against 1.276 without, and
  15,411.6 against 19,257.1 tok/s: wide launches lose;
- the Llama-3.1-8B shape's fused layer lost with it (T = 4: 6.48 vs 5.50 ms); on the H100
  (forty-fifth session, profiles/results/2026-12-06_h100_session45/) with its deep-K tiles,
  decode with lm_head 6.807 ms with PDL against 5.963 without, propose k=5 1.716 against
  1.584: the next kernel's programs, resident early, take the GEMM's SMs while they wait
  (cuBLAS with PDL changed nothing: 6.298 vs 6.294 ms, thirty-eighth session).
So the default is on only where it measured faster: CUDA on Hopper or newer, the fused layer on,
layer weights of at most ``PDL_MAX_WEIGHT`` elements (SmolLM2's 1.8M gained, the 8B shape's
16.8M-117M lost), and calls of at most ``PDL_MAX_ROWS`` rows. Inductor's half is a compile
option, so an engine whose widest decode call (``max_num_seqs`` x rows per request) stays within
that bound compiles one target with PDL; a wider one compiles its target twice
(``CompileConfig.pdl_narrow``): with PDL for the graphs of at most ``PDL_MAX_ROWS`` rows,
without for the rest (``PdlChoice.max_rows``). Without that split an EAGLE-3 engine of 64
requests ran every step without PDL, its paused steps at batch 1 0.935 ms against a vanilla
engine's 0.764 (H100, fortieth session). The draft decides by its own widest call (its first
pass, or a tree's expansions), with no split: a tree engine whose verify is too wide keeps PDL
on its draft.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.dispatch import PDL_MAX_ROWS

# Elements of a model's largest layer weight up to which PDL is the default: between the sizes
# measured, SmolLM2's 1.8M (faster with it) and the 8B shape's 16.8M and up (slower).
PDL_MAX_WEIGHT = 4 * 1024 * 1024


@dataclass(frozen=True)
class PdlChoice:
    on: bool
    why: str  # what decided it (engine stats: ``compile_stats["pdl"]``)
    # With ``on``: PDL only for graphs whose calls have at most this many rows (a second
    # compile of the target serves them); None: every call.
    max_rows: int | None = None


def inductor_has_pdl() -> bool:
    import torch._inductor.config as inductor

    return hasattr(inductor.triton, "enable_pdl")


def pdl_auto(device_type: str, capability: tuple[int, int] | None, inductor_pdl: bool,
             fused_layer: bool, max_decode_rows: int | None, narrow: bool = False,
             largest_weight: int = 0) -> PdlChoice:
    """The default for one engine (a pure function of what it is given). ``narrow``: a wide
    engine may take PDL on its narrow calls (``CompileConfig.pdl_narrow``);
    ``largest_weight``: elements of the model's largest layer weight."""
    if device_type != "cuda":
        return PdlChoice(False, f"auto: off on {device_type} (PDL is a CUDA launch attribute)")
    if capability is None or capability < (9, 0):
        return PdlChoice(False, f"auto: off, compute capability {capability} < (9, 0) "
                                "(PDL needs Hopper or newer)")
    if not inductor_pdl:
        return PdlChoice(False, f"auto: off, torch {torch.__version__}'s Inductor has no "
                                "triton.enable_pdl")
    if not fused_layer:
        return PdlChoice(False, "auto: off without the fused layer (measured faster only with "
                                "it; the 8B shape's cuBLAS layer gained nothing from it)")
    if largest_weight > PDL_MAX_WEIGHT:
        return PdlChoice(False, f"auto: off, largest layer weight {largest_weight} elements > "
                                f"{PDL_MAX_WEIGHT} (the 8B shape's fused layer measured slower "
                                "with PDL)")
    if max_decode_rows is None:
        return PdlChoice(False, "auto: off, the engine's widest decode call is not known")
    if max_decode_rows > PDL_MAX_ROWS and narrow:
        return PdlChoice(True, f"auto: on for calls of <= {PDL_MAX_ROWS} rows, off for wider "
                               f"(widest decode call {max_decode_rows}; a 96-row verify "
                               "measured slower with PDL)", max_rows=PDL_MAX_ROWS)
    if max_decode_rows > PDL_MAX_ROWS:
        return PdlChoice(False, f"auto: off, widest decode call {max_decode_rows} rows > "
                                f"{PDL_MAX_ROWS} (a 96-row verify measured slower with PDL)")
    return PdlChoice(True, f"auto: on, fused layer and widest decode call {max_decode_rows} "
                           f"rows <= {PDL_MAX_ROWS}")


def resolve_pdl(pdl: bool | None, device: torch.device, fused_layer: bool,
                max_decode_rows: int | None, narrow: bool | None = False,
                largest_weight: int = 0) -> PdlChoice:
    """``CompileConfig.pdl`` with None resolved for an engine on ``device``; ``narrow``:
    ``CompileConfig.pdl_narrow`` (None: as pdl=None decides; True: with pdl=True too);
    ``largest_weight``: as ``pdl_auto``."""
    if pdl is False:
        return PdlChoice(False, "set: pdl=False")
    if pdl:
        wide = max_decode_rows is None or max_decode_rows > PDL_MAX_ROWS
        if narrow and wide:
            return PdlChoice(True, f"set: pdl=True, pdl_narrow=True: on for calls of <= "
                                   f"{PDL_MAX_ROWS} rows (widest {max_decode_rows})",
                             max_rows=PDL_MAX_ROWS)
        return PdlChoice(True, "set: pdl=True")
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return pdl_auto(device.type, cap, inductor_has_pdl(), fused_layer, max_decode_rows,
                    narrow is not False, largest_weight)
