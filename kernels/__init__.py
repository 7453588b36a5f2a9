"""Kernels: Triton implementations for the GPU and their exact PyTorch references."""
from kernels.ops import paged_attention, rope_write_kv, write_kv

__all__ = ["paged_attention", "rope_write_kv", "write_kv"]
