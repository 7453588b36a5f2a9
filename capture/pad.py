"""Padding a live batch up to a captured size with INERT rows, into preallocated static buffers.

Padding convention (what ``kernels/`` accept, checked by tests/test_capture.py):

* Padded **token** rows (``num_tokens .. padded_tokens``): input_id 0, position 0, slot -1. Slot -1
  makes ``write_kv`` skip the row (both kernels test ``slot < 0``), so padding never touches the KV
  cache. These rows belong to no sequence (``query_start_loc[-1]`` stays at the live token count),
  so paged attention never reads them and returns zeros for them; the rest of the model computes
  finite garbage there, which ``GraphRunner`` slices away. Their ``rows`` (buffers with row
  sources) are 0: row 0 of a source, a valid row, so the graph's gather never reads out of range.
* Padded **sequence** rows (``num_seqs .. padded_seqs``): q_len 0 (query_start_loc repeats the live
  token count, as vLLM pads it), seq_len 0, block table all block 0. q_len 0 makes the Triton
  kernel return before reading anything else; seq_len 0 (not 1) means "no context", so padding
  never raises the batch's max_seq_len (the bucket, see ``capture.policy``), and the reference
  kernel masks the row entirely. Block id 0 is a valid index into the pool, so even a kernel that
  read a padded table could not fault; it is never dereferenced for a q_len-0 row.
* Live rows are copied unchanged; live block-table rows are zero-filled past their width.

The functions here take an optional ``out``: without it they allocate (tests, references); with it
they copy in place (``StaticBuffers.fill`` at replay time: no allocation, no host sync).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Mapping

import torch

from compiled_spec.attention_metadata import AttentionMetadata

# trailing shape and dtype of an extra per-token / per-sequence input (e.g. the draft's hidden)
ExtraSpec = tuple[tuple[int, ...], torch.dtype]
# rows, trailing shape and dtype of a row source: an extra the graph gathers by ``LiveBatch.rows``
SourceSpec = tuple[int, tuple[int, ...], torch.dtype]


@dataclass
class LiveBatch:
    """The inputs of one forward. For an S-step loop (the captured draft loop) positions,
    slot_mapping and seq_lens carry a leading step dimension; everything else is shared."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, or [S, T] for an S-step loop
    meta: AttentionMetadata  # slot_mapping [T] | [S, T]; seq_lens [B] | [S, B]; tables [B, W]
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # [T, ...] or [B, ...]
    # [T] int64: each token's row in the row-source extras ([R, ...], any R), which the graph
    # gathers itself; None when the batch has no row sources.
    rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.meta.query_start_loc.shape[0] - 1

    @property
    def num_steps(self) -> int:
        return self.positions.shape[0] if self.positions.dim() == 2 else 1

    def step(self, j: int) -> tuple[torch.Tensor, AttentionMetadata]:
        """(positions [T], metadata) of step j of a loop batch (views: no copy, no allocation).
        max_seq_len is the bound over all steps, which is what a captured loop bakes in."""
        if self.positions.dim() == 1:
            if j != 0:
                raise IndexError(f"step {j} of a single-step batch")
            return self.positions, self.meta
        m = self.meta
        return self.positions[j], AttentionMetadata(
            slot_mapping=m.slot_mapping[j], block_tables=m.block_tables, seq_lens=m.seq_lens[j],
            query_start_loc=m.query_start_loc, max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len)


def stack_steps(steps: list[tuple[torch.Tensor, AttentionMetadata]], input_ids: torch.Tensor,
                extras: Mapping[str, torch.Tensor] | None = None) -> LiveBatch:
    """Host-built per-step (positions, metadata) of a one-token-per-request loop -> one LiveBatch
    with [S, B] positions / slots / seq_lens, so the whole loop can replay as one graph. Every
    step must share block tables and query_start_loc (grow the tables for all k lookahead
    positions before building the steps, as the proposer already does)."""
    first = steps[0][1]
    return LiveBatch(
        input_ids=input_ids,
        positions=torch.stack([p for p, _ in steps]),
        meta=AttentionMetadata(
            slot_mapping=torch.stack([m.slot_mapping for _, m in steps]),
            block_tables=first.block_tables, seq_lens=torch.stack([m.seq_lens for _, m in steps]),
            query_start_loc=first.query_start_loc,
            max_query_len=max(m.max_query_len for _, m in steps),
            max_seq_len=max(m.max_seq_len for _, m in steps)),
        extras=dict(extras or {}))


def pad_dim(src: torch.Tensor, size: int, value: int | float, dim: int = 0,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``src`` padded along ``dim`` to ``size`` with ``value``; written into ``out`` if given."""
    n = src.shape[dim]
    if n > size:
        raise ValueError(f"pad_dim: {n} rows do not fit in {size}")
    if out is None:
        shape = list(src.shape)
        shape[dim] = size
        out = src.new_empty(shape)
    out.narrow(dim, 0, n).copy_(src, non_blocking=True)
    if size > n:  # an empty fill_ still costs a dispatch on the step's host-bound path
        out.narrow(dim, n, size - n).fill_(value)
    return out


def pad_block_tables(block_tables: torch.Tensor,  # [B, W] int32
                     padded_seqs: int, width: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:  # [padded_seqs, width]
    """Rows and columns padded with the dummy (valid) block id 0."""
    b, w = block_tables.shape
    if out is None:
        out = block_tables.new_empty((padded_seqs, w if width is None else width))
    if b > out.shape[0] or w > out.shape[1]:
        raise ValueError(f"block tables {tuple(block_tables.shape)} do not fit in "
                         f"{tuple(out.shape)}")
    out[:b, :w].copy_(block_tables, non_blocking=True)
    if w < out.shape[1]:  # (empty fills skipped: a dispatch each on the host-bound path)
        out[:b, w:].fill_(0)
    if b < out.shape[0]:
        out[b:].fill_(0)
    return out


def pad_query_start_loc(query_start_loc: torch.Tensor,  # [B + 1] int32
                        padded_seqs: int, num_tokens: int,
                        out: torch.Tensor | None = None) -> torch.Tensor:  # [padded_seqs + 1]
    """Padded sequences get q_len 0: their start and end both equal the live token count (a host
    int, so no read-back of query_start_loc[-1] is needed)."""
    return pad_dim(query_start_loc, padded_seqs + 1, num_tokens, out=out)


def pad_metadata(meta: AttentionMetadata, padded_tokens: int, padded_seqs: int,
                 num_tokens: int, max_query_len: int | None = None,
                 max_seq_len: int | None = None, *, block_width: int | None = None,
                 out: AttentionMetadata | None = None) -> AttentionMetadata:
    """Metadata padded with inert rows. The host ints default to the live ones; a graph passes
    its captured values (>= live, see capture.policy). Works for [T] and [S, T] slot mappings."""
    o = out
    return AttentionMetadata(
        slot_mapping=pad_dim(meta.slot_mapping, padded_tokens, -1, dim=-1,
                             out=None if o is None else o.slot_mapping),
        block_tables=pad_block_tables(meta.block_tables, padded_seqs, block_width,
                                      out=None if o is None else o.block_tables),
        seq_lens=pad_dim(meta.seq_lens, padded_seqs, 0, dim=-1,
                         out=None if o is None else o.seq_lens),
        query_start_loc=pad_query_start_loc(meta.query_start_loc, padded_seqs, num_tokens,
                                            out=None if o is None else o.query_start_loc),
        max_query_len=meta.max_query_len if max_query_len is None else max_query_len,
        max_seq_len=meta.max_seq_len if max_seq_len is None else max_seq_len)


def pad_batch(live: LiveBatch, padded_tokens: int, padded_seqs: int,
              max_query_len: int | None = None, max_seq_len: int | None = None,
              seq_extras: Collection[str] = (), sources: Collection[str] = ()) -> LiveBatch:
    """Allocating version of ``StaticBuffers.fill``. Extras named in ``seq_extras`` are
    per-sequence ([B, ...]); those in ``sources`` row sources, kept as they are; the others
    per-token ([T, ...]). Padding is zeros, and padded tokens read row 0 of the sources."""
    return LiveBatch(
        input_ids=pad_dim(live.input_ids, padded_tokens, 0),
        positions=pad_dim(live.positions, padded_tokens, 0, dim=-1),
        meta=pad_metadata(live.meta, padded_tokens, padded_seqs, live.num_tokens,
                          max_query_len, max_seq_len),
        extras={k: v if k in sources else
                pad_dim(v, padded_seqs if k in seq_extras else padded_tokens, 0)
                for k, v in live.extras.items()},
        rows=None if live.rows is None else pad_dim(live.rows, padded_tokens, 0))


class StaticBuffers:
    """Max-size input tensors that captured graphs read from: allocated once, refilled in place
    before every replay, so pointers stay fixed and replay allocates nothing.

    ``fill`` returns views ``[:padded]`` of these buffers; the same views (same data_ptr, same
    strides) are what the graph was captured with. Block tables keep their full max_blocks width
    so the row stride never changes. Create them outside inference mode (plain tensors can be
    refilled in and out of it; inference tensors only inside).

    ``row_sources``: extras of their own row count whose rows the graph gathers itself, by the
    int64 ``rows`` [max_tokens] staged with the other integers (one upload, no index kernel
    before the replay). They are copied in as they are and never sliced: a padded token reads
    row 0, a valid row, and only live tokens' rows are ever read back.
    """

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device,
                 num_steps: int = 1, token_extras: Mapping[str, ExtraSpec] | None = None,
                 seq_extras: Mapping[str, ExtraSpec] | None = None,
                 row_sources: Mapping[str, SourceSpec] | None = None) -> None:
        if min(max_tokens, max_seqs, max_blocks, num_steps) < 1:
            raise ValueError("StaticBuffers: sizes must be >= 1")
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.num_steps = num_steps
        self.device = torch.device(device)
        t, b, s = max_tokens, max_seqs, num_steps
        # Two flat buffers (int64, int32) with every integer input as a view: a host-built batch
        # lands in them in two copies (``capture.host_stage``). The int32 tables come last so a
        # copy of the prefix up to the live rows' tables carries everything.
        # ``lead``: the [max_tokens] segments before the positions (rows only with row sources,
        # so the other graphs' uploads do not grow).
        self.lead = lead = 4 if row_sources else 3
        self.flat64 = torch.zeros(t * (lead + 2 * s), dtype=torch.int64, device=self.device)
        self.input_ids = self.flat64[:t]  # [max_tokens]
        self.draft_dst = self.flat64[t:2 * t]  # rows of input_ids taking device-resident drafts
        self.draft_src = self.flat64[2 * t:3 * t]  # ... from these flat draft indices
        self.rows = self.flat64[3 * t:4 * t] if row_sources else None  # [max_tokens]
        self.positions = self.flat64[lead * t:(lead + s) * t].view(s, t)  # [S, max_tokens]
        self.slot_mapping = self.flat64[(lead + s) * t:].view(s, t)  # [S, max_tokens]
        self.slot_mapping.fill_(-1)
        self.flat32 = torch.zeros(s * b + b + 1 + b * max_blocks, dtype=torch.int32,
                                  device=self.device)
        self.seq_lens = self.flat32[:s * b].view(s, b)  # [S, max_seqs]
        self.query_start_loc = self.flat32[s * b:s * b + b + 1]  # [max_seqs + 1]
        self.block_tables = self.flat32[s * b + b + 1:].view(b, max_blocks)  # [max_seqs, W]
        self.extras: dict[str, torch.Tensor] = {}
        self._seq_extras = set((seq_extras or {}).keys())
        self._view_cache: dict[tuple[int, int, int, int], LiveBatch] = {}
        for specs, rows in ((token_extras or {}, max_tokens), (seq_extras or {}, max_seqs)):
            for name, (shape, dtype) in specs.items():
                self.extras[name] = torch.zeros((rows, *shape), dtype=dtype, device=self.device)
        self.sources = set((row_sources or {}).keys())
        for name, (rows, shape, dtype) in (row_sources or {}).items():
            if name in self.extras:
                raise ValueError(f"StaticBuffers: extra {name!r} given twice")
            self.extras[name] = torch.zeros((rows, *shape), dtype=dtype, device=self.device)

    def _views(self, t: int, b: int, max_query_len: int, max_seq_len: int) -> LiveBatch:
        # The same few shapes every step: build each set of views once (a dozen slices and two
        # dataclasses cost ~10 us of host time per step otherwise).
        key = (t, b, max_query_len, max_seq_len)
        view = self._view_cache.get(key)
        if view is None:
            view = self._view_cache[key] = self._make_views(*key)
        return view

    def _make_views(self, t: int, b: int, max_query_len: int, max_seq_len: int) -> LiveBatch:
        # Single-step batches see 1-D [T] / [B] views; loops see [S, T] / [S, B].
        one = self.num_steps == 1
        return LiveBatch(
            input_ids=self.input_ids[:t],
            positions=self.positions[0, :t] if one else self.positions[:, :t],
            meta=AttentionMetadata(
                slot_mapping=self.slot_mapping[0, :t] if one else self.slot_mapping[:, :t],
                block_tables=self.block_tables[:b], seq_lens=self.seq_lens[0, :b] if one
                else self.seq_lens[:, :b], query_start_loc=self.query_start_loc[:b + 1],
                max_query_len=max_query_len, max_seq_len=max_seq_len),
            extras={k: v if k in self.sources else v[:b] if k in self._seq_extras else v[:t]
                    for k, v in self.extras.items()},
            rows=None if self.rows is None else self.rows[:t])

    def sources_fit(self, extras: Mapping[str, torch.Tensor] | None) -> bool:
        """Whether each row source given fits its static buffer (the caller counts a miss)."""
        return all(extras[k].shape[0] <= self.extras[k].shape[0]
                   for k in self.sources if extras and k in extras)

    def fill(self, live: LiveBatch, padded_tokens: int, padded_seqs: int,
             max_query_len: int, max_seq_len: int) -> LiveBatch:
        """Copy ``live`` into the buffers, padded with inert rows to (padded_tokens,
        padded_seqs); returns the static views with the graph's host ints."""
        t, b = live.num_tokens, live.num_seqs
        if not (t <= padded_tokens <= self.max_tokens and b <= padded_seqs <= self.max_seqs):
            raise ValueError(f"live batch (tokens={t}, seqs={b}) -> padded ({padded_tokens}, "
                             f"{padded_seqs}) does not fit buffers ({self.max_tokens}, "
                             f"{self.max_seqs})")
        if live.num_steps != self.num_steps:
            raise ValueError(f"live batch has {live.num_steps} steps, buffers {self.num_steps}")
        if live.meta.max_query_len > max_query_len or live.meta.max_seq_len > max_seq_len:
            raise ValueError(f"live host ints (max_query_len={live.meta.max_query_len}, "
                             f"max_seq_len={live.meta.max_seq_len}) exceed the graph's "
                             f"({max_query_len}, {max_seq_len})")
        if set(live.extras) != set(self.extras):
            raise ValueError(f"extras {sorted(live.extras)} != buffers' {sorted(self.extras)}")
        if not self.sources_fit(live.extras):
            raise ValueError(f"row sources {sorted(self.sources)} exceed their buffers")
        if (live.rows is None) != (self.rows is None):
            raise ValueError(f"live batch rows {'absent' if live.rows is None else 'given'}, "
                             f"buffers' row sources {sorted(self.sources)}")
        view = self._views(padded_tokens, padded_seqs, max_query_len, max_seq_len)
        pad_dim(live.input_ids, padded_tokens, 0, out=view.input_ids)
        pad_dim(live.positions, padded_tokens, 0, dim=-1, out=view.positions)
        pad_metadata(live.meta, padded_tokens, padded_seqs, t, out=view.meta)
        if live.rows is not None:
            pad_dim(live.rows, padded_tokens, 0, out=view.rows)
        for k, v in live.extras.items():
            if k in self.sources:  # as it is: rows past the live ones are never read
                view.extras[k][:v.shape[0]].copy_(v, non_blocking=True)
            else:
                pad_dim(v, view.extras[k].shape[0], 0, out=view.extras[k])
        return view

    def fill_dummy(self, padded_tokens: int, padded_seqs: int, query_len: int,
                   max_seq_len: int) -> LiveBatch:
        """Inputs for the start-up dummy runs: the tokens split as evenly as they go among
        padded_seqs sequences of at most query_len tokens (exactly query_len each when they
        fill them: the fixed-shape graphs), every slot -1 so warm-up and capture never write
        the (possibly live) KV cache. Start-up only: the temporaries are fine."""
        if padded_tokens > padded_seqs * query_len:
            raise ValueError(f"dummy batch: {padded_tokens} tokens > {padded_seqs} seqs x "
                             f"{query_len}")
        view = self._views(padded_tokens, padded_seqs, query_len, max_seq_len)
        base, extra = divmod(padded_tokens, padded_seqs)
        q_lens = torch.full((padded_seqs,), base, dtype=torch.int32, device=self.device)
        q_lens[:extra] += 1
        qsl = torch.zeros(padded_seqs + 1, dtype=torch.int32, device=self.device)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        starts = torch.repeat_interleave(qsl[:-1].long(), q_lens.long(),
                                         output_size=padded_tokens)
        view.input_ids.zero_()
        # each token's index within its sequence; broadcast over the step dim if any
        view.positions.copy_(torch.arange(padded_tokens, device=self.device) - starts)
        view.meta.slot_mapping.fill_(-1)
        view.meta.block_tables.zero_()
        view.meta.seq_lens.copy_(q_lens)
        view.meta.query_start_loc.copy_(qsl)
        if view.rows is not None:
            view.rows.zero_()  # row 0 of every source
        for v in view.extras.values():
            v.zero_()
        return view


def as_static(live: LiveBatch) -> LiveBatch:
    """``live`` copied into fresh ``StaticBuffers`` of exactly its size, as normal tensors
    (not inference tensors, though the engine runs under inference mode): the views a
    captured graph's body reads, with the same bases and dispatch keys, so a compiled callable
    that graphs captured takes a step outside them without compiling again."""
    t, b = live.num_tokens, live.num_seqs
    with torch.inference_mode(False):
        bufs = StaticBuffers(max(t, 1), max(b, 1), max(live.meta.block_tables.shape[1], 1),
                             live.input_ids.device, num_steps=live.num_steps)
    return bufs.fill(live, t, b, live.meta.max_query_len, live.meta.max_seq_len)
