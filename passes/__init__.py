"""FX passes and the torch.compile backend of compiled_spec.

``make_backend`` (passes.pipeline) is the entry point; the pass order is ``PASS_ORDER``
(then ``POST_GRAD_ORDER`` inside Inductor) there.
"""
from passes.base import DUMP_ENV, GraphPass, hash_source
from passes.bind_attn_metadata import BindPerLayerAttnMetadata
from passes.hoist_fc import HoistEagle3Fc, HoistedPart
from passes.noop_elim import NoOpElimination
from passes.pipeline import (PASS_ORDER, POST_GRAD_ORDER, CompiledSpecBackend, PassManager,
                             default_passes, make_backend)
from passes.skinny_gemm import SkinnyGemmFusion
from passes.unfuse_addmm import UnfuseResidualAddmm

__all__ = [
    "DUMP_ENV", "GraphPass", "hash_source", "BindPerLayerAttnMetadata", "HoistEagle3Fc",
    "HoistedPart", "NoOpElimination", "SkinnyGemmFusion", "UnfuseResidualAddmm", "PASS_ORDER",
    "POST_GRAD_ORDER",
    "CompiledSpecBackend", "PassManager",
    "default_passes", "make_backend",
]
