"""Writes into a graph's static buffers from inside a compiled function.

A graph body that computes another graph's inputs on the device (an early tree step lays out
the late first pass's and expansion's metadata, ``compiled_spec/engine/early_tree_graph.py``)
used to copy each result into the static views afterwards: one copy kernel per view (12 per
early tree step, 1-2 us each on the H100 in the thirty-eighth session's trace). Handing the
results to the late bodies as they are compiles those bodies again (Dynamo guards on the
views' bases and dispatch keys). Instead the compiled function writes its results into the
flat buffers the views live in: ``region`` says where a view lies in its flat buffer (host
ints, fixed per buffers), ``write_regions`` (traced inside the compiled function) stores each
value there, so Inductor writes them from the kernels that compute them.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from capture.pad import StaticBuffers


class Region(NamedTuple):
    flat: int  # index into the flat buffers handed to write_regions
    offset: int  # elements from the flat buffer's start
    row_stride: int  # 0: the view is contiguous (written flat); else [rows, n] rows this far apart


def region(buffers: StaticBuffers, view: torch.Tensor, first_flat: int = 0,
           steps: bool = False) -> Region:
    """Where ``view`` (one of ``buffers``' views) lies: flat ``first_flat`` is the buffers'
    int64 one, ``first_flat + 1`` its int32 one. ``steps``: an [S, n] view of a loop's
    per-step rows (positions, slots, lengths), written row by row; else a contiguous view,
    written flat. The caller says which, not the view's contiguity: the largest batch's
    [S, n] view is contiguous and the others' are not, and one layout for every batch size
    keeps the compiled writer to one graph."""
    for i, flat in enumerate((buffers.flat64, buffers.flat32)):
        if view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
            offset = view.storage_offset() - flat.storage_offset()
            if steps and view.dim() == 2 and view.stride(1) == 1:
                return Region(first_flat + i, offset, view.stride(0))
            if not steps and view.is_contiguous():
                return Region(first_flat + i, offset, 0)
            raise ValueError(f"view of shape {tuple(view.shape)}, strides {view.stride()}: "
                             f"not {'[S, n] rows' if steps else 'contiguous'}")
    raise ValueError("view is not in these buffers' flat int64 / int32 storage")


def write_regions(flats: Sequence[torch.Tensor], regions: Sequence[Region],
                  values: Sequence[torch.Tensor]) -> None:
    """Store each value at its region (cast to the buffer's dtype). A flat region takes the
    value's elements in order; a row-strided one row i from the value's ``[i]``, one row at a
    time. Only 1-D contiguous slices of the buffers are viewed in a value's shape, which has
    one stride layout for every batch size: a value's own reshape, or a view of an [S, n]
    slice (contiguous exactly when n fills the row), made Dynamo guard on the batch size."""
    for r, v in zip(regions, values):
        flat = flats[r.flat]
        # narrow, not a slice: a slice's end is clamped to the size, a min() over the
        # batch-dependent length that Dynamo guarded on too
        if r.row_stride == 0:
            flat.narrow(0, r.offset, v.numel()).view(v.shape).copy_(v)
        else:
            n = v[0].numel()
            for i in range(v.shape[0]):  # rows: the loop's steps, a constant
                flat.narrow(0, r.offset + i * r.row_stride, n).view(v[i].shape).copy_(v[i])
