"""Kernels: Triton implementations for the GPU and their exact PyTorch references."""
from kernels.ops import paged_attention, write_kv

__all__ = ["paged_attention", "write_kv"]
