"""Target features for EAGLE-3 training: aux hidden states and soft labels, recomputed per batch.

The target's aux hidden states and logits are not stored with the data: ``TargetFeaturizer``
recomputes them per batch (one no-grad target forward), which costs less than the draft's own
training step on large targets and saves [S, 3h + V] floats per token of disk.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from compiled_spec.engine.batch import Span, build_metadata
from compiled_spec.kv_cache import BlockAllocator, allocate_kv_pair
from compiled_spec.models.decoder import CausalLM

if TYPE_CHECKING:
    from compiled_spec.train.packing import PackedBatch


class TargetFeaturizer:
    """Runs the (frozen) target over whole training sequences and returns what the draft learns
    from: the aux hidden states (EAGLE-3 input) and the target logits (soft labels).

    The sequences are packed into one flat token batch over a private paged KV cache, so padding
    costs nothing and the target runs its real attention path (paged op: Triton on GPU). The cache
    is bound only for the call; the target's previous caches (e.g. the engine's) are restored.
    """

    def __init__(self, target: CausalLM, aux_layer_ids: tuple[int, ...],
                 vocab_ids: torch.Tensor | None = None, page_size: int = 16,
                 compiled: bool = False) -> None:
        self.target = target
        # compiled: the target's forward through torch.compile with our backend, as the engine
        # runs its prefills (dynamic token counts; Inductor fuses the norms, rope and SiLU that
        # run unfused in eager mode, about a third of a packed training step's GPU time).
        self._forward = target
        if compiled:
            from compiled_spec.compile import CompileConfig, compile_callable
            from passes import make_backend

            self._forward = compile_callable(
                target, make_backend(hoist_fc=False, per_layer_metadata=False), CompileConfig())
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.page_size = page_size
        w = target.lm_head.weight
        # Logits only at the draft vocab: [B, S, V] fp32 would dominate memory for 128k vocabs.
        self.head = w if vocab_ids is None else w[vocab_ids.to(w.device)]  # [V_out, h]
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._num_blocks = 0

    def _ensure_cache(self, num_blocks: int) -> None:
        if num_blocks <= self._num_blocks:
            return
        cfg, p = self.target.config, self.target.lm_head.weight
        self._caches = [allocate_kv_pair(num_blocks, self.page_size, cfg.num_key_value_heads,
                                         cfg.head_dim, p.dtype, p.device)
                        for _ in range(cfg.num_hidden_layers)]
        self._num_blocks = num_blocks

    @torch.no_grad()  # not inference_mode: the outputs feed autograd (fc saves its input)
    def _flat(self, flat_ids: torch.Tensor,  # [T] int64, sequences back to back
              lens: list[int],
              ) -> tuple[torch.Tensor, torch.Tensor]:  # (final [T, h] normed, aux [T, n*h])
        device = flat_ids.device
        alloc = BlockAllocator(sum(-(-n // self.page_size) for n in lens), self.page_size)
        self._ensure_cache(alloc.num_blocks)
        for i, n in enumerate(lens):
            alloc.grow(i, n)
        positions, meta = build_metadata(alloc, [Span(i, 0, n) for i, n in enumerate(lens)],
                                         device)
        layers = self.target.model.layers
        saved = [(l.self_attn.k_cache, l.self_attn.v_cache) for l in layers]
        self.target.bind_kv_cache(self._caches)
        try:
            final, aux = self._forward(flat_ids, positions, meta, self.aux_layer_ids)
        finally:
            for l, (k, v) in zip(layers, saved):
                l.self_attn.k_cache, l.self_attn.v_cache = k, v
        return final, torch.cat(aux, dim=-1)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor,  # [B, S] int64, right-padded
                 lengths: torch.Tensor,  # [B]
                 ) -> tuple[torch.Tensor, torch.Tensor]:  # (aux [B, S, n*h], logits [B, S, V_out])
        b, s = input_ids.shape
        valid = torch.arange(s, device=input_ids.device)[None, :] < lengths[:, None]  # [B, S]
        # input_ids[valid] is row-major == the spans' order
        final, aux_cat = self._flat(input_ids[valid], [int(n) for n in lengths.tolist()])
        logits = F.linear(final, self.head).float()  # [T, V_out]
        aux_out = aux_cat.new_zeros(b, s, aux_cat.shape[-1])
        logit_out = logits.new_zeros(b, s, logits.shape[-1])
        aux_out[valid] = aux_cat
        logit_out[valid] = logits
        return aux_out, logit_out

    @torch.no_grad()
    def packed(self, batch: "PackedBatch") -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, n*h], final hidden [T, h]) of a packed batch, zeros on its tail. The
        logits are left to the loss, which forms them from ``final`` and ``self.head`` chunk
        by chunk."""
        n = batch.num_tokens
        final, aux_cat = self._flat(batch.input_ids[:n], batch.lengths)
        pad = batch.input_ids.shape[0] - n
        return F.pad(aux_cat, (0, 0, 0, pad)), F.pad(final, (0, 0, 0, pad))
