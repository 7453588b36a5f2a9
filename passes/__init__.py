"""FX passes and the torch.compile backend of compiled_spec.

``make_backend`` (passes.pipeline) is the entry point; the pass order is ``PASS_ORDER`` there.
"""
from passes.base import DUMP_ENV, GraphPass, hash_source
from passes.bind_attn_metadata import BindPerLayerAttnMetadata
from passes.hoist_fc import HoistEagle3Fc, HoistedPart
from passes.noop_elim import NoOpElimination
from passes.pipeline import (PASS_ORDER, CompiledSpecBackend, PassManager, default_passes,
                             make_backend)

__all__ = [
    "DUMP_ENV", "GraphPass", "hash_source", "BindPerLayerAttnMetadata", "HoistEagle3Fc",
    "HoistedPart", "NoOpElimination", "PASS_ORDER", "CompiledSpecBackend", "PassManager",
    "default_passes", "make_backend",
]
