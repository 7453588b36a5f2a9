"""Greedy picks over a vocabulary: ``torch.argmax`` along rows, as two reductions.

The draft's greedy pick is an argmax over [B, V] logits (V = 32k) for a handful of rows. A
one-stage argmax gives each row to one program, which walks all V values alone: in the H200
trace of a chain proposal, Inductor's fused argmax took 6.4 us per draft step, a third of the
step's draft forward (results/2026-12-02_h200_session13/). Splitting the row into chunks makes
the first reduction [B * V / chunk] programs wide; the second picks among the chunk maxima.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 1024  # values per first-stage row: 32 of them for a 32k vocabulary


def rowwise_argmax(x: torch.Tensor,  # [R, V]
                   chunk: int = CHUNK) -> torch.Tensor:  # [R] int64
    """Exactly ``x.argmax(-1)``: the first index of each row's maximum (a NaN counts as the
    maximum, as there). Each chunk reports its maximum and that maximum's first index; the
    first chunk holding the row's maximum then has the row's first maximal index, because
    every earlier chunk's maximum is smaller."""
    r, v = x.shape
    if v <= 2 * chunk:  # a split buys nothing for short rows
        return x.argmax(-1)
    c = -(-v // chunk)
    if c * chunk != v:  # -inf never wins over a real value (an all -inf row: index 0, as argmax)
        x = F.pad(x, (0, c * chunk - v), value=float("-inf"))
    vals, idx = x.view(r, c, chunk).max(-1)  # [R, C] each chunk's maximum, its first index
    best = vals.argmax(-1, keepdim=True)  # [R, 1] the first chunk holding the row's maximum
    return (best * chunk + idx.gather(1, best)).squeeze(1)
