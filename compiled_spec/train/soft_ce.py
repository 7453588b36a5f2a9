"""Soft cross-entropy of the draft's readout against the target's distribution, fused with both
readouts and chunked over rows, so no [N, V] tensor outlives a chunk.

The unfused loss keeps, per TTT step, fp32 draft logits, their log-softmax and the target's
probabilities ([N, V] each, ~3 GB at N = 24k, V = 32k) for backward. Here each chunk of rows
computes its draft and target logits from the hidden states, the loss and, right away, the
gradient with respect to the draft hidden (and the readout when it trains): d CE / d logits =
softmax(draft) - p_target. Backward only scales what forward kept ([N, h]).
"""
from __future__ import annotations

from typing import Callable

import torch

ChunkFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def _chunk(h: torch.Tensor,  # [c, H] draft hidden for the readout, compute dtype
           w: torch.Tensor,  # [V, H] draft readout
           th: torch.Tensor,  # [c, H] target final hidden (its label rows)
           tw: torch.Tensor,  # [V, H] target readout at the draft vocabulary
           weight: torch.Tensor,  # [c] fp32 loss weight per row (0: not trained)
           inv_temp: float = 1.0,  # 1 / the label temperature (see soft_cross_entropy)
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ce [c], hits [c], grad_h [c, H], grad_logits [c, V] in the compute dtype)."""
    ld = (h @ w.t()).float()  # [c, V]
    lt = (th @ tw.t()).float() * inv_temp  # [c, V]
    lse = torch.logsumexp(ld, dim=-1)  # [c]
    p = torch.softmax(lt, dim=-1)  # [c, V]
    # sum_v p_v = 1, so -sum_v p_v log_softmax(ld)_v = lse - sum_v p_v ld_v.
    ce = lse - (p * ld).sum(-1)  # [c]
    hits = ld.argmax(-1) == lt.argmax(-1)  # [c]
    g = ((torch.exp(ld - lse[:, None]) - p) * weight[:, None]).to(h.dtype)  # [c, V]
    return ce, hits, g @ w, g


_compiled: dict[str, ChunkFn] = {}


def chunk_fn(compiled: bool) -> ChunkFn:
    """The chunk body, compiled once per process when asked (Inductor fuses the [c, V] softmax
    passes into a few kernels; chunks are padded to one shape, so it compiles once)."""
    if not compiled:
        return _chunk
    if "fn" not in _compiled:
        _compiled["fn"] = torch.compile(_chunk, dynamic=False)
    return _compiled["fn"]


class _SoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, th: torch.Tensor, tw: torch.Tensor,
                weight: torch.Tensor, chunk: int, fn: ChunkFn, inv_temp: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n, cd = h.shape[0], th.dtype
        wc, twc = w.to(cd), tw.to(cd)
        pad = -n % chunk
        # Padding rows (zeros, weight 0) keep every chunk one shape: one compile, no recompiles.
        hp = torch.nn.functional.pad(h.to(cd), (0, 0, 0, pad))
        thp = torch.nn.functional.pad(th, (0, 0, 0, pad))
        wp = torch.nn.functional.pad(weight.float(), (0, pad))
        ces, hits, grads = [], [], []
        grad_w = torch.zeros_like(w, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for a in range(0, n + pad, chunk):
            hc = hp[a:a + chunk]
            ce, hit, gh, g = fn(hc, wc, thp[a:a + chunk], twc, wp[a:a + chunk], inv_temp)
            ces.append(ce)
            hits.append(hit)
            grads.append(gh)
            if grad_w is not None:
                grad_w += (g.t() @ hc).float()  # [V, H]
        ce = torch.cat(ces)[:n]
        hit = torch.cat(hits)[:n]
        # Rows of weight 0 may hold anything (untrained chain positions): where, not multiply.
        loss = torch.where(weight != 0, ce * weight.float(), 0.0).sum()
        ctx.save_for_backward(torch.cat(grads)[:n].to(h.dtype),
                              grad_w if grad_w is not None else torch.empty(0))
        ctx.w_dtype = w.dtype
        ctx.mark_non_differentiable(ce, hit)
        return loss, ce, hit

    @staticmethod
    def backward(ctx, g_loss: torch.Tensor, *_):
        grad_h, grad_w = ctx.saved_tensors
        gw = (grad_w * g_loss).to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        return grad_h * g_loss, gw, None, None, None, None, None, None


def soft_cross_entropy(h: torch.Tensor,  # [N, H] draft hidden for the readout
                       w: torch.Tensor,  # [V, H] draft readout (may train)
                       th: torch.Tensor,  # [N, H] target final hidden at each row's label
                       tw: torch.Tensor,  # [V, H] target readout rows of the draft vocabulary
                       weight: torch.Tensor,  # [N] loss weight per row
                       chunk: int = 8192, compiled: bool = False,
                       label_temperature: float = 1.0,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_i weight_i * CE_i, CE [N] detached, hits [N] bool: draft argmax == target argmax).

    CE_i = -sum_v softmax(th_i tw^T / T)_v log_softmax(h_i w^T)_v, T = ``label_temperature``;
    logits are formed in the target hidden's dtype (bf16 on the GPU, as autocast would) and
    reduced in fp32. T < 1 sharpens the labels toward the target's argmax (T -> 0: the
    hard-label CE), the token greedy verification accepts; T = 1 learns the distribution that
    sampled verification accepts from."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk}: must be >= 1")
    if not label_temperature > 0:
        raise ValueError(f"label_temperature={label_temperature!r}: must be > 0")
    return _SoftCE.apply(h, w, th.detach(), tw.detach(), weight.detach(), chunk,
                         chunk_fn(compiled), 1.0 / label_temperature)
