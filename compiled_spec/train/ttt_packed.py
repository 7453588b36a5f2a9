"""Training-time test over a packed batch: the function of ``ttt.py`` (same index convention,
same modules) on sequences laid back to back in one row, with block-sparse attention and the
fused soft cross-entropy.

``ttt.py`` pads sequences into [B, S] and gives SDPA a dense [S, s*S] mask per step, so step s
pays for s*S keys per query although only the causal prefix and s-1 single entries are visible.
Here step s attends over a key buffer of ``num_steps`` blocks of T (step t's K/V in block t-1,
zeros for steps not yet run) under a flex-attention ``BlockMask`` built from the sequence
layout: only the causal blocks of each sequence and the 128-row bands of the diagonal entries
are computed, and every step has one shape, so the kernel compiles once. On the CPU (no flex
backward) the same mask is dense and goes to SDPA: the reference the tests compare.

Rows at a sequence's end read the next sequence's first token, and rows at its start read the
previous sequence's last feed-back: neither is trained nor attended by a trained row (a trained
row of step s attends step-t keys only at positions >= t-1 of its own sequence).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from compiled_spec.draft.model import DraftLayer, EagleDraft, project_qkv
from compiled_spec.models.decoder import Attention
from compiled_spec.train.packing import ALIGN, PackedBatch
from compiled_spec.train.soft_ce import soft_cross_entropy
from compiled_spec.train.ttt import TTTOutput

_FLEX: dict[str, object] = {}


def _flex():
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


class PackedTTTMask:
    """Which keys each query of step s sees, for one packed batch (shared by every layer).
    Key index kv = b*T + k is position k of block b (step b+1); query j of step s sees
      block 0:              k <= j - s + 1 in j's sequence (the first pass up to the chain root),
      block b, 1 <= b < s:  k == j - s + b + 1 in j's sequence (one entry per later step)."""

    def __init__(self, positions: torch.Tensor,  # [T] int64 position within the sequence
                 num_steps: int, flex: bool) -> None:
        self.num_steps, self.flex = num_steps, flex
        self.t, self.device = positions.numel(), positions.device
        # [T] where each row's sequence starts (the batch's tail rows are their own start)
        self.start = torch.arange(self.t, device=self.device) - positions
        self._blocks: dict[int, object] = {}

    def allowed(self, q: torch.Tensor, kv: torch.Tensor, step: torch.Tensor | int
                ) -> torch.Tensor:
        return _allowed(self.start, self.t, q, kv, step)

    def dense(self, step: int) -> torch.Tensor:  # [T, step*T] bool
        t = self.t
        q = torch.arange(t, device=self.device)[:, None]
        kv = torch.arange(step * t, device=self.device)[None, :]
        return self.allowed(q, kv, step)

    def block(self, step: int):
        """The flex ``BlockMask`` of step ``step`` over a key buffer of num_steps blocks, built
        from per-row key intervals at block granularity (never a [T, steps*T] tensor)."""
        if step in self._blocks:
            return self._blocks[step]
        from torch.nn.attention.flex_attention import BlockMask

        t, dev = self.t, self.device
        if t % ALIGN:
            raise ValueError(f"packed length {t} must be a multiple of {ALIGN}")
        nq, nk = t // ALIGN, t // ALIGN
        j = torch.arange(t, device=dev)
        # Block 0: row j sees the interval [start_j, j - step + 1] of its own sequence.
        lo, hi = self.start, j - step + 1  # [T]
        kb = torch.arange(nk, device=dev)
        k0, k1 = kb * ALIGN, kb * ALIGN + ALIGN - 1  # [nk] block bounds
        any0 = (torch.maximum(lo[:, None], k0) <= torch.minimum(hi[:, None], k1))  # [T, nk]
        full0 = (lo[:, None] <= k0) & (hi[:, None] >= k1)  # [T, nk]
        any_blocks = torch.zeros(nq, self.num_steps * nk, dtype=torch.bool, device=dev)
        any_blocks[:, :nk] = any0.view(nq, ALIGN, nk).any(1)
        full_blocks = torch.zeros_like(any_blocks)
        full_blocks[:, :nk] = full0.view(nq, ALIGN, nk).all(1)
        # Blocks b = 1..step-1: one key, j - step + b + 1, when it is in j's sequence.
        for b in range(1, step):
            k = j - step + b + 1
            ok = k >= self.start
            col = b * nk + torch.div(k.clamp(min=0), ALIGN, rounding_mode="floor")
            any_blocks[(j // ALIGN)[ok], col[ok]] = True
        partial = any_blocks & ~full_blocks
        # The closure holds tensors and the (fixed) length only, so the compiled kernel treats
        # them as inputs: new batches and steps reuse it without recompiling.
        step_t, start = torch.tensor(step, device=dev), self.start

        def mask_mod(b, h, q_idx, kv_idx):
            return _allowed(start, t, q_idx, kv_idx, step_t)

        num, idx = _ordered(partial)
        fnum, fidx = _ordered(full_blocks)
        mask = BlockMask.from_kv_blocks(num[None, None], idx[None, None], fnum[None, None],
                                        fidx[None, None], BLOCK_SIZE=ALIGN, mask_mod=mask_mod,
                                        seq_lengths=(t, self.num_steps * t))
        self._blocks[step] = mask
        return mask


def _allowed(start: torch.Tensor, t: int, q: torch.Tensor, kv: torch.Tensor,
             step: torch.Tensor | int) -> torch.Tensor:
    blk, k = kv // t, kv % t
    same = k >= start[q]  # every visible key is at or before q: in q's sequence
    first = (blk == 0) & (k <= q - step + 1)
    later = (blk >= 1) & (blk < step) & (k == q - step + blk + 1)
    return same & (first | later)


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nk] bool -> (count [nq] int32, indices [nq, nk] int32: the True columns first)."""
    num = dense.sum(-1).to(torch.int32)
    idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True)
    return num, idx.to(torch.int32)


def _layer_in(layer: DraftLayer, x: torch.Tensor,  # [1, T, h] stream entering the layer
              embeds: torch.Tensor,  # [1, T, h]
              cos: torch.Tensor, sin: torch.Tensor,  # [T, head_dim]
              ) -> tuple[torch.Tensor, ...]:  # q, k, v (project_qkv), residual [1, T, h]
    attn_in, residual = layer.attn_input(x, embeds)
    return (*project_qkv(layer.self_attn, attn_in, cos, sin), residual)


def _layer_out(layer: DraftLayer, attn: torch.Tensor,  # [1, T, heads * head_dim]
               residual: torch.Tensor) -> torch.Tensor:  # [1, T, h]
    return layer.finish(layer.self_attn.o_proj(attn), residual)


_PIECES = (_layer_in, _layer_out, EagleDraft._outputs)


@functools.cache
def _compiled_pieces() -> tuple:
    return tuple(torch.compile(f, dynamic=False) for f in _PIECES)


def _pieces(compiled: bool) -> tuple:
    """(layer_in, layer_out, readout (``EagleDraft._outputs``)): the dense parts of a TTT step
    around the attention. Compiled (``TrainConfig.compile_ttt``), each is one Inductor graph
    forward and backward: eagerly their norms, rope, SiLU-mul, residual adds and autocast casts
    are ~30 elementwise kernels per layer and step over [T, h], most of a training step's
    non-GEMM GPU time and of its host launches (H200 profile,
    results/2026-12-01_h200_packed-ttt/). The batch is packed to one token budget, so each
    compiles once (dynamic=False), once per process."""
    return _compiled_pieces() if compiled else _PIECES


def _attend(attn: Attention, q: torch.Tensor,  # [1, heads, T, d]
            kv: list[tuple[torch.Tensor, torch.Tensor]], step: int,
            mask: PackedTTTMask) -> torch.Tensor:  # [1, T, heads * d]
    t = q.shape[2]
    k = kv[-1][0]
    if mask.flex:
        zeros = [torch.zeros_like(k)] * (mask.num_steps - len(kv))
        keys = torch.cat([kk for kk, _ in kv] + zeros, dim=2)  # [1, kv_heads, steps*T, d]
        values = torch.cat([vv for _, vv in kv] + zeros, dim=2)
        out = _flex()(q, keys, values, block_mask=mask.block(step), scale=attn.scale,
                      enable_gqa=True)
    else:
        group = attn.num_heads // attn.num_kv_heads
        keys = torch.cat([kk for kk, _ in kv], dim=2).repeat_interleave(group, dim=1)
        values = torch.cat([vv for _, vv in kv], dim=2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.dense(step),
                                             scale=attn.scale)
    return out.transpose(1, 2).reshape(1, t, attn.num_heads * attn.head_dim)


def packed_ttt_forward(draft: EagleDraft, batch: PackedBatch,
                       hidden: torch.Tensor,  # [T, h] step-1 hidden: combine_aux(aux_j)
                       num_steps: int, flex: bool, compiled: bool = False,
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:  # per step, each [T, h]
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be >= 1")
    draft_in = F.pad(batch.input_ids[1:], (0, 1))  # [T]: t_{j+1}
    embeds = draft.embed(draft_in)[None]  # [1, T, h]
    cos, sin = draft.rotary_emb(batch.positions, embeds.dtype)  # [T, head_dim]
    mask = PackedTTTMask(batch.positions, num_steps, flex)
    kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in draft.layers]
    hidden = hidden[None]  # [1, T, h]
    layer_in, layer_out, readout = _pieces(compiled)
    outs = []
    for step in range(1, num_steps + 1):
        x = draft._prologue(embeds, hidden)
        for layer, layer_kv in zip(draft.layers, kv):
            q, k, v, residual = layer_in(layer, x, embeds, cos, sin)
            layer_kv.append((k, v))
            x = layer_out(layer, _attend(layer.self_attn, q, layer_kv, step, mask), residual)
        feed, for_logits = readout(draft, x)
        outs.append((feed[0], for_logits[0]))
        hidden = F.pad(feed[:, :-1], (0, 0, 1, 0))  # step s+1 at j reads step s's feed at j-1
    return outs


def packed_trainable_rows(batch: PackedBatch) -> torch.Tensor:  # [N] int64
    """Rows j whose label t_{j+2} is one of the target's tokens in j's own sequence."""
    nxt = F.pad(batch.loss_mask[2:], (0, 2), value=False)
    # j + 2 is in j's sequence iff its position is two further (positions restart at 0)
    same = F.pad(batch.positions[2:], (0, 2), value=-1) == batch.positions + 2
    return (nxt & same).nonzero().squeeze(1)  # one host sync per batch


def packed_ttt_loss(draft: EagleDraft, batch: PackedBatch,
                    aux: torch.Tensor,  # [T, n*target_h]
                    target_final: torch.Tensor,  # [T, target_h] the target's normed hidden
                    target_head: torch.Tensor,  # [V_draft, target_h] its readout rows
                    num_steps: int, decay: float = 0.8, flex: bool = False,
                    chunk: int = 8192, compiled_ce: bool = False,
                    copy_weight: float = 1.0, tail_weight: float = 1.0,
                    label_temperature: float = 1.0, compiled: bool = False) -> TTTOutput:
    """``copy_weight``: loss weight of rows whose label a context lookup predicts
    (``batch.copyable``; the target's loops), relative to the others' 1; ``tail_weight``: of
    rows whose label is in a reply's tail (``batch.tail``); the two multiply.
    ``label_temperature``: the labels are softmax(target logits / it) (``soft_cross_entropy``);
    ``compiled``: the step's dense pieces through torch.compile (``_pieces``)."""
    n_aux = len(draft.aux_layer_ids) or 1
    hidden = draft.combine_aux(list(aux.chunk(n_aux, dim=-1)))  # [T, h]
    outs = packed_ttt_forward(draft, batch, hidden, num_steps, flex, compiled)
    rows = packed_trainable_rows(batch)  # [N]
    root = batch.positions[rows]  # [N] step s needs a chain root j - s + 1 >= 0
    label_h = target_final[rows + 1]  # [N, h]: the target's distribution for t_{j+2}
    copy = batch.copyable[rows + 2]  # [N] the label t_{j+2} is copyable
    row_w = (torch.where(copy, copy_weight, 1.0)
             * torch.where(batch.tail[rows + 2], tail_weight, 1.0))  # [N]
    total = aux.new_zeros((), dtype=torch.float32)
    stats = []
    for step, (_, for_logits) in enumerate(outs, 1):
        m = root >= step - 1  # [N]
        n = m.sum()
        w = m.float() * row_w
        weight = w / w.sum().clamp(min=1e-9)
        loss, ce, hits = soft_cross_entropy(for_logits[rows], draft.lm_head.weight, label_h,
                                            target_head, weight, chunk, compiled_ce,
                                            label_temperature)
        total = total + decay ** (step - 1) * loss
        # the step's plain mean CE (the loss is the weighted one) and its hit counts
        mean_ce = torch.where(m, ce, 0.0).sum() / n.clamp(min=1)
        novel = m & ~copy
        stats.append(torch.stack([mean_ce, (hits & m).sum().float(), n.float(),
                                  (hits & novel).sum().float(), novel.sum().float()]))
    host = torch.stack(stats).tolist()
    return TTTOutput(total, [r[0] for r in host], [r[1] / max(r[2], 1) for r in host],
                     [int(r[2]) for r in host], [r[3] / max(r[4], 1) for r in host],
                     [int(r[4]) for r in host])
