"""A batch built on the host, staged straight into a graph's static buffers: two copies per step.

The engine builds every integer input of a step (ids, positions, slots, sequence lengths, query
starts, block tables) from its own Python state. Turning those lists into live device tensors
and then padding them into the static buffers cost ~20 small launches per target step (tensor
creation, a copy and a fill per field); at batch 1 a SmolLM2 decode step is host-bound, so each
one shows. Here the lists are written, already padded (same inert rows as ``capture.pad``), into
numpy mirrors of ``StaticBuffers.flat64`` / ``flat32`` and uploaded in two copies; the drafts,
which live on the device, are then moved into their input rows by one gather + one scatter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from capture.pad import LiveBatch, StaticBuffers


def staging(n: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """A host buffer for uploads to ``device`` and its numpy view (written by the host code).

    Pinned on CUDA: a copy from pageable memory goes through a driver staging buffer and may
    synchronise with the stream first (CUDA's API notes), which would make the host wait for
    the replay still running before it could launch the next one. A pinned buffer may only be
    rewritten once its last copy has run; every engine step ends with its one device-to-host
    read of the results, which orders all of the step's copies before the next step's writes.
    """
    t = torch.zeros(n, dtype=dtype, pin_memory=device.type == "cuda")
    return t, t.numpy()


def put(arr: np.ndarray, live: list, size: int, pad: int) -> None:
    """``arr[:size]`` = the live values, then ``pad`` up to the padded size."""
    arr[:len(live)] = live
    arr[len(live):size] = pad


def put_tables(tab: np.ndarray, tables: list[list[int]]) -> None:
    """``tab`` [padded_seqs, W]: each request's block table, zero-padded (padded sequences get
    table 0: their rows are inert, slot -1). One masked store of every entry (row-major, so in
    table order) instead of a store per request."""
    tab[:] = 0
    if not tables:
        return
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    n, w = len(tables), int(lens.max())
    if w:
        tab[:n, :w][np.arange(w) < lens[:, None]] = np.fromiter(
            chain.from_iterable(tables), dtype=tab.dtype, count=int(lens.sum()))


def put_rows(buf: torch.Tensor, rows: torch.Tensor) -> None:
    """``buf[:len(rows)] = rows`` on the device, unless ``rows`` are those very rows (a
    producer that wrote into the buffer already: no launch)."""
    dst = buf[:rows.shape[0]]
    if rows.data_ptr() != dst.data_ptr() or rows.stride() != dst.stride():
        dst.copy_(rows)


Ints = list[int] | np.ndarray  # host integers of one step: a list, or a 1-D int64 array


@dataclass
class HostBatch:
    """A flat batch as host lists, or 1-D numpy arrays for a single step (``Span`` layout,
    inert padding already applied to rows past a request's write limit). An S-step loop (a
    draft-tree expansion) gives positions, slots and seq_lens one list per step, as
    ``LiveBatch`` does with a leading step dimension."""

    input_ids: Ints  # [T]; rows in draft_dst are placeholders
    positions: Ints | list[list[int]]  # [T] or [S][T]
    slots: Ints | list[list[int]]  # [T] or [S][T], -1 = write nothing
    seq_lens: Ints | list[list[int]]  # [B] or [S][B]
    query_start_loc: Ints | range  # [B + 1]
    tables: list[list[int]]  # [B][blocks]
    max_query_len: int
    max_seq_len: int
    draft_dst: Ints = field(default_factory=list)  # rows of input_ids ...
    draft_src: Ints = field(default_factory=list)  # ... taking drafts_flat[src]
    # [T]: each token's row in the row-source extras (``StaticBuffers(row_sources=...)``),
    # gathered inside the graph; empty for buffers without row sources.
    rows: list[int] = field(default_factory=list)
    # (width, first): every request's rows are ``width`` wide and its columns first.. take the
    # last width - first drafts of its row of a 2-D drafts tensor (request i, row i): the
    # draft rows above in a form one strided copy stages (``HostStage.fill``), where the
    # index lists cost a gather and a scatter. Set by callers whose rows line up so.
    draft_grid: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_steps(self) -> int:
        return len(self.positions) if len(self.positions) and isinstance(self.positions[0], list) \
            else 1

    @property
    def num_seqs(self) -> int:
        return len(self.query_start_loc) - 1

    @property
    def width(self) -> int:
        return max((len(t) for t in self.tables), default=0)


class HostStage:
    """Numpy mirrors of one ``StaticBuffers`` (single-step or an S-step loop) and the two
    uploads into it; extras (device tensors: hidden states, tree masks) are copied in, one
    copy each."""

    def __init__(self, bufs: StaticBuffers) -> None:
        self.bufs = bufs
        self.t64, self.h64 = staging(bufs.flat64.numel(), torch.int64, bufs.device)
        self.t32, self.h32 = staging(bufs.flat32.numel(), torch.int32, bufs.device)
        t, b, s, lead = bufs.max_tokens, bufs.max_seqs, bufs.num_steps, bufs.lead
        self.h64[(lead + s) * t:] = -1  # slots of rows never written: inert
        self._ids, self._dst, self._src = (self.h64[i * t:(i + 1) * t] for i in range(3))
        self._rows = self.h64[3 * t:4 * t] if bufs.rows is not None else None  # [max_tokens]
        self._pos = self.h64[lead * t:(lead + s) * t].reshape(s, t)  # [S, max_tokens]
        self._slots = self.h64[(lead + s) * t:(lead + 2 * s) * t].reshape(s, t)  # [S, max_tokens]
        self._lens = self.h32[:s * b].reshape(s, b)  # [S, max_seqs]
        self._qsl = self.h32[s * b:s * b + b + 1]
        self._tables = self.h32[s * b + b + 1:].reshape(b, bufs.max_blocks)
        # (padded tokens, padded seqs) -> the two uploads' (device, host) views
        self._uploads: dict[tuple[int, int], tuple[tuple[torch.Tensor, torch.Tensor], ...]] = {}
        # Recorded after the uploads: the next fill waits for it before rewriting the pinned
        # mirrors. An engine step's own device-to-host read usually orders them already
        # (``staging``), but a step launched ahead of that read (vanilla decode ahead,
        # compiled_spec/engine/verify_ahead.py) is staged after it; then this wait is what
        # keeps the next fill off a copy the GPU has not run yet (it runs first in the stream
        # once the host has read the step, so the wait is short).
        self._uploaded = torch.cuda.Event() if bufs.device.type == "cuda" else None

    def fill(self, hb: HostBatch, padded_tokens: int, padded_seqs: int, max_query_len: int,
             max_seq_len: int, drafts_flat: torch.Tensor | None,
             extras: dict[str, torch.Tensor] | None = None) -> LiveBatch:
        """Stage ``hb`` padded to (padded_tokens, padded_seqs); returns the static views with
        the graph's host ints. ``drafts_flat``: the device drafts that draft_src indexes
        (flat), or 2-D where ``hb.draft_grid`` places them;
        ``extras``: the buffers' extras as device tensors ([T, ...] or [B, ...]; a row source
        [R, ...] with R up to its buffer's rows, which ``hb.rows`` index)."""
        bufs, t, b = self.bufs, hb.num_tokens, hb.num_seqs
        s = bufs.num_steps
        if not (t <= padded_tokens <= bufs.max_tokens and b <= padded_seqs <= bufs.max_seqs):
            raise ValueError(f"host batch (tokens={t}, seqs={b}) -> padded ({padded_tokens}, "
                             f"{padded_seqs}) does not fit buffers ({bufs.max_tokens}, "
                             f"{bufs.max_seqs})")
        if hb.width > bufs.max_blocks:
            raise ValueError(f"block tables of {hb.width} blocks exceed {bufs.max_blocks}")
        if hb.num_steps != s:
            raise ValueError(f"host batch has {hb.num_steps} steps, buffers {s}")
        if set(extras or {}) != set(bufs.extras):
            raise ValueError(f"extras {sorted(extras or {})} != buffers' {sorted(bufs.extras)}")
        if not bufs.sources_fit(extras):
            raise ValueError(f"row sources {sorted(bufs.sources)} exceed their buffers")
        if len(hb.rows) != (t if self._rows is not None else 0):
            raise ValueError(f"host batch has {len(hb.rows)} rows for {t} tokens; buffers' row "
                             f"sources: {sorted(bufs.sources)}")
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the last uploads from these mirrors have run
        put(self._ids, hb.input_ids, padded_tokens, 0)
        if self._rows is not None:  # padded tokens read row 0 of every source: a valid row
            put(self._rows, hb.rows, padded_tokens, 0)
        steps = zip(*((hb.positions, hb.slots, hb.seq_lens) if s > 1
                      else ([hb.positions], [hb.slots], [hb.seq_lens])))
        for j, (pos, slots, lens) in enumerate(steps):
            put(self._pos[j], pos, padded_tokens, 0)
            put(self._slots[j], slots, padded_tokens, -1)
            put(self._lens[j], lens, padded_seqs, 0)
        # A grid of drafts (2-D drafts): one strided copy after the uploads, no index lists.
        grid = hb.draft_grid if drafts_flat is not None and drafts_flat.dim() == 2 else None
        n_d = 0 if grid is not None else len(hb.draft_dst)
        if n_d:
            self._dst[:n_d] = hb.draft_dst
            self._src[:n_d] = hb.draft_src
        put(self._qsl, hb.query_start_loc, padded_seqs + 1, t)
        put_tables(self._tables[:padded_seqs], hb.tables)
        up = self._uploads.get((padded_tokens, padded_seqs))
        if up is None:  # the same few sizes every step: four slices made once per size
            end64 = (bufs.lead + 2 * s - 1) * bufs.max_tokens + padded_tokens
            end32 = (s + 1) * bufs.max_seqs + 1 + padded_seqs * bufs.max_blocks
            up = self._uploads[(padded_tokens, padded_seqs)] = (
                (bufs.flat64[:end64], self.t64[:end64]), (bufs.flat32[:end32], self.t32[:end32]))
        for dst, src in up:
            dst.copy_(src, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        if grid is not None:
            w, first = grid
            c = drafts_flat.shape[1]
            bufs.input_ids[:t].view(t // w, w)[:, first:].copy_(  # [n, w - first]
                drafts_flat[:t // w, c - (w - first):])
        elif n_d:
            if drafts_flat is None:
                raise ValueError("host batch has draft rows but no drafts were given")
            bufs.input_ids.index_copy_(0, bufs.draft_dst[:n_d], drafts_flat.reshape(-1)
                                       .index_select(0, bufs.draft_src[:n_d]))
        view = bufs._views(padded_tokens, padded_seqs, max_query_len, max_seq_len)
        for name, v in (extras or {}).items():  # padding rows zeroed, as StaticBuffers.fill
            dst = view.extras[name]
            live = dst if dst.shape[0] == v.shape[0] else dst[:v.shape[0]]
            # An extra its producer wrote in place (an early tree graph's depths and masks)
            # needs no copy.
            if (v.data_ptr() != live.data_ptr() or v.shape != live.shape
                    or v.stride() != live.stride()):
                live.copy_(v, non_blocking=True)
            # A row source's rows past the live ones are never read: not worth a launch.
            if dst.shape[0] > v.shape[0] and name not in bufs.sources:
                dst[v.shape[0]:].zero_()
        return view
