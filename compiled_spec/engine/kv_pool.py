"""The paged KV pool of an engine: how many blocks, and one K and one V tensor per layer."""
from __future__ import annotations

import torch

from compiled_spec.config import EngineConfig
from compiled_spec.draft.model import EagleDraft
from compiled_spec.kv_cache import BlockAllocator, allocate_kv_pair, bytes_per_block
from compiled_spec.memory import available_bytes, check_kv_pool_fits
from compiled_spec.models.decoder import CausalLM


def _kv_budget_bytes(cfg: EngineConfig) -> int:
    """The KV pool's size: the configured GiB, else half the free memory on a GPU (the weights
    are already loaded, so what is free is what the pool may take) and on the CPU 1 GiB, or
    half of what is available when that is less."""
    if cfg.cache.memory_gib is not None:
        return int(cfg.cache.memory_gib * (1 << 30))
    avail = available_bytes(cfg.device)
    if cfg.device.type == "cuda":
        return (avail or 0) // 2
    return 1 << 30 if avail is None else min(1 << 30, avail // 2)


def build_kv_pool(cfg: EngineConfig, model: CausalLM, draft: EagleDraft | None
                  ) -> tuple[BlockAllocator, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The block allocator and the (K, V) cache pair of every target layer, then every draft
    layer. Draft layers keep their KV in the same paged pool: same blocks, same slots, own
    tensors; this rank's KV heads (all of them without tensor parallelism)."""
    mcfg, page = model.config, cfg.cache.page_size
    kv_shapes = [(layer.self_attn.num_kv_heads, mcfg.head_dim) for layer in model.model.layers]
    if draft is not None:
        kv_shapes += [(layer.self_attn.num_kv_heads, draft.config.head_dim)
                      for layer in draft.layers]
    num_blocks = cfg.cache.num_blocks
    per_block = sum(bytes_per_block(page, h, d, cfg.dtype) for h, d in kv_shapes)
    if num_blocks is None:
        num_blocks = max(1, _kv_budget_bytes(cfg) // per_block)
        tp = getattr(model, "tp", None)
        if tp is not None:  # every rank must hold the same number of blocks (lockstep)
            import torch.distributed as dist

            n = torch.tensor([num_blocks], device=cfg.device)
            dist.all_reduce(n, op=dist.ReduceOp.MIN, group=tp.group)
            num_blocks = int(n.item())
    asked = (f"num_kv_blocks={cfg.cache.num_blocks}" if cfg.cache.num_blocks is not None else
             f"kv_cache_memory_gib={cfg.cache.memory_gib}")
    check_kv_pool_fits(num_blocks, per_block, cfg.device, asked)
    allocator = BlockAllocator(num_blocks, page, prefix_caching=cfg.cache.prefix_caching)
    # One tensor per layer, not views of one pool: torch.compile treats inputs that share
    # storage as aliases and copied the whole pool per layer and step (2026-12-01).
    caches = [allocate_kv_pair(num_blocks, page, h, d, cfg.dtype, cfg.device)
              for h, d in kv_shapes]
    return allocator, caches
