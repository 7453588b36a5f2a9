"""Host-side construction of flat token batches, their attention metadata and the per-row sampling
parameters.

Everything here is built from the engine's own Python state and moved to the device in one go;
nothing reads back from the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import numpy as np
import torch

from capture.host_stage import HostBatch, put_tables
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.engine.request import Request
from compiled_spec.kv_cache import BlockAllocator, extend_slots
from compiled_spec.sampler import SamplingTensors


@dataclass
class Span:
    """``length`` consecutive query tokens of one request starting at absolute ``start``.

    Positions at or beyond ``write_limit`` are inert: they write no KV (slot -1) and attend as if
    at ``write_limit - 1`` (whose KV exists), so padding rows never reach past the request's blocks.
    """

    req_id: int
    start: int
    length: int
    write_limit: int | None = None


def metadata_to_device(device: torch.device, positions: list[int] | list[list[int]],
                       slots: list[int] | list[list[int]], seq_lens: list[int] | list[list[int]],
                       qsl: list[int], tables: list[list[int]], max_query_len: int,
                       max_seq_len: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """Host lists -> (positions, metadata) on ``device`` in two host->device copies (one int64,
    one int32 buffer), then views: each copy is a launch plus a staging memcpy, and a step
    builds these every time. Block tables are zero-padded to the widest.

    Every view starts 16 bytes into its buffer times n (segments zero-padded): Triton compiles
    one binary per pointer alignment (16-byte divisible or not), so views at offsets set by the
    token and sequence counts made prompt steps JIT-compile attention and rope kernels that
    start-up had compiled for aligned pointers (H200: 0.5 s inside a request, session 21)."""
    # Lists -> numpy -> torch: ~3x faster than torch.tensor(list) at a thousand requests.
    pos = np.asarray(positions, dtype=np.int64)  # [T] or [S, B]
    n = _align(pos.size, 2)  # int64 elements per 16 bytes
    i64_np = np.zeros(2 * n, dtype=np.int64)
    i64_np[:pos.size] = pos.reshape(-1)
    i64_np[n:n + pos.size] = np.asarray(slots, dtype=np.int64).reshape(-1)
    lens = np.array(seq_lens, dtype=np.int32)
    width = max(2, max(len(t) for t in tables))
    b = len(tables)
    o_qsl = _align(lens.size, 4)  # int32 elements per 16 bytes
    o_tab = o_qsl + _align(b + 1, 4)
    i32_np = np.zeros(o_tab + b * width, dtype=np.int32)
    i32_np[:lens.size] = lens.reshape(-1)
    i32_np[o_qsl:o_qsl + b + 1] = qsl
    i32_np[o_tab:] = padded_tables(tables, width).reshape(-1)
    i64, i32 = torch.from_numpy(i64_np), torch.from_numpy(i32_np)
    if device.type != "cpu":
        i64, i32 = i64.to(device, non_blocking=True), i32.to(device, non_blocking=True)
    meta = AttentionMetadata(
        slot_mapping=i64[n:n + pos.size].view(pos.shape),
        block_tables=i32[o_tab:].view(b, width),
        seq_lens=i32[:lens.size].view(lens.shape), query_start_loc=i32[o_qsl:o_qsl + b + 1],
        max_query_len=max_query_len, max_seq_len=max_seq_len)
    return i64[:pos.size].view(pos.shape), meta


def _align(n: int, m: int) -> int:
    """``n`` rounded up to a multiple of ``m``."""
    return -(-n // m) * m


def padded_tables(tables: list[list[int]], width: int) -> np.ndarray:
    """[B, width] int32 block tables, zero-padded: one masked store of all entries (row-major,
    so in table order) instead of a padded Python list per row."""
    out = np.zeros((len(tables), width), dtype=np.int32)
    put_tables(out, tables)
    return out


def greedy_accept(target: list[int], drafts: list[int], k: int) -> list[int]:
    """Greedy verification on the host, from the step's one copy: the leading drafts (at most
    ``k``) equal to the target's argmax at their positions, then the target's next token.
    ``target`` holds the argmax of the k + 1 verified rows (longer is fine: only those are
    read)."""
    n = 0
    while n < k and drafts[n] == target[n]:
        n += 1
    return target[:n + 1]


def span_rows(allocator: BlockAllocator, spans: list[Span]
              ) -> tuple[list[int], list[int], list[int], list[int]]:
    """Host lists of a flat batch of ``spans``: positions and slots per token, seq_lens per
    span, query_start_loc. Positions at or past a span's write limit are inert (see Span)."""
    if sum(s.length for s in spans) >= SPAN_ROWS_NUMPY:
        return span_rows_np(allocator, spans)
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    qsl = [0]
    page, tables = allocator.page_size, allocator.tables
    # Hot: every token of every running request, every step; the slot arithmetic is inlined.
    for s in spans:
        if s.length == 1 and s.write_limit is None:  # a decode row: no ranges, no slices
            p = s.start
            positions.append(p)
            slots.append(tables[s.req_id][p // page] * page + p % page)
            seq_lens.append(p + 1)
            qsl.append(qsl[-1] + 1)
            continue
        end = s.start + s.length
        live_end = end if s.write_limit is None else min(end, s.write_limit)
        table = tables[s.req_id] if live_end > s.start else ()
        positions.extend(range(s.start, live_end))
        extend_slots(slots, table, page, s.start, live_end)
        if live_end < end:  # inert rows past the write limit
            pad = max(live_end, s.start)
            positions.extend([s.write_limit - 1] * (end - pad))
            slots.extend([-1] * (end - pad))
        seq_lens.append(positions[-1] + 1 if s.length else s.start)
        qsl.append(qsl[-1] + s.length)
    return positions, slots, seq_lens, qsl


# From this many tokens on, ``span_rows`` runs vectorised (a prompt step at batch 64 has
# thousands of rows, each a few Python operations); below it numpy's per-call overhead would
# cost more than the loop.
SPAN_ROWS_NUMPY = 256


def span_rows_np(allocator: BlockAllocator, spans: list[Span]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``span_rows`` with numpy: the same rows as int64 arrays (query_start_loc too)."""
    page, tables = allocator.page_size, allocator.tables
    n = len(spans)
    starts = np.fromiter((s.start for s in spans), dtype=np.int64, count=n)
    lens = np.fromiter((s.length for s in spans), dtype=np.int64, count=n)
    limits = np.fromiter((s.start + s.length if s.write_limit is None else s.write_limit
                          for s in spans), dtype=np.int64, count=n)
    if n and lens[0] > 0 and (lens == lens[0]).all() and (limits == starts + lens).all():
        return _uniform_rows(tables, page, spans, starts, int(lens[0]))
    qsl = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    seg = np.repeat(np.arange(n), lens)  # [T] each row's span
    pos = starts[seg] + np.arange(int(qsl[-1])) - qsl[:-1][seg]  # [T]
    # Only spans with a live row read a table (an all-inert span may have none), as span_rows.
    rows = [tables[s.req_id] if min(s.start + s.length, lim_i) > s.start else ()
            for s, lim_i in zip(spans, limits.tolist())]
    have = np.fromiter(map(len, rows), dtype=np.int64, count=n)
    tab = padded_tables(rows, max(1, int(have.max()) if n else 1))  # [n, W]
    pos, slots, live = _inert_rows(tab, seg, pos, limits[seg], page)
    if np.any(live & (pos // page >= have[seg])):
        raise IndexError("span_rows: a live position lies past its request's block table")
    last = qsl[1:] - 1  # each span's last row (a span of length 0: its start)
    seq_lens = np.where(lens > 0, pos[np.maximum(last, 0)] + 1 if len(pos) else 0, starts)
    return pos, slots, seq_lens, qsl


def _uniform_rows(tables: dict[int, list[int]], page: int, spans: list[Span],
                  starts: np.ndarray, q: int
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``span_rows_np`` of spans of one length ``q`` > 0 without write limits (a paused
    engine's flush of 32 positions per request: every row live): ``chain_rows``' [n, q] grid,
    no per-row segment arrays: 0.134 against 0.287 ms for 64 x 32 rows on the CPU in
    isolation (fiftieth session). ``chain_rows`` clamps to the table, so the check past it is
    made here first."""
    rows = [tables[s.req_id] for s in spans]
    have = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    if ((starts + q - 1) // page >= have).any():  # each span's last row has its largest block
        raise IndexError("span_rows: a live position lies past its request's block table")
    pos, slots, seq_lens = chain_rows(rows, page, starts, None, q)
    return pos, slots, seq_lens, np.arange(0, len(rows) * q + 1, q, dtype=np.int64)


def _inert_rows(tab: np.ndarray, row: np.ndarray, pos: np.ndarray, lim: np.ndarray, page: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, slots, live) of rows at ``pos`` reading block-table row ``row`` of ``tab``
    (both broadcast with ``pos``): a row at or past its limit ``lim`` is inert (as
    ``Span.write_limit``), at position lim - 1 with slot -1."""
    live = pos < lim
    pos = np.where(live, pos, lim - 1)
    blk = np.minimum(pos // page, tab.shape[1] - 1)  # inert rows may point past the table
    return pos, np.where(live, tab[row, blk] * page + pos % page, -1), live


def chain_rows(tables: list[list[int]], page: int, starts: list[int],
               limits: list[int] | None, q: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``span_rows`` for spans of one length ``q`` (a chain step: each request's last token
    and k drafts), vectorised: ``span_rows``' per-row Python had the largest own time in a
    cProfile of a batch-64 step, called twice a step (twenty-third session). ``tables``: each
    span's request's block table; ``limits``: each span's write limit (positions from it on
    are inert, as ``Span.write_limit``), or None for none. Returns positions [n*q], slots
    [n*q] (int64) and seq_lens [n]."""
    tab = padded_tables(tables, max(1, max(map(len, tables))))  # [n, W]
    first = np.asarray(starts, dtype=np.int64)[:, None]  # [n, 1]
    pos = first + np.arange(q)  # [n, q]
    lim = first + q if limits is None else np.asarray(limits, dtype=np.int64)[:, None]
    pos, slots, _ = _inert_rows(tab, np.arange(len(tables))[:, None], pos, lim, page)
    return pos.reshape(-1), slots.reshape(-1), pos[:, -1] + 1


def build_chain_batch(allocator: BlockAllocator, req_ids: list[int], starts: list[int],
                      limits: list[int] | None, q: int, input_ids: np.ndarray,
                      draft_dst: np.ndarray, draft_src: np.ndarray,
                      draft_grid: tuple[int, int] | None = None) -> HostBatch:
    """``build_host_batch`` of a chain step's spans (all of length ``q``, see ``chain_rows``),
    its lists numpy arrays."""
    tables = [allocator.tables[r] for r in req_ids]
    positions, slots, seq_lens = chain_rows(tables, allocator.page_size, starts, limits, q)
    n = len(req_ids)
    return HostBatch(input_ids=input_ids, positions=positions, slots=slots, seq_lens=seq_lens,
                     query_start_loc=range(0, n * q + 1, q), tables=tables, max_query_len=q,
                     max_seq_len=int(seq_lens.max()), draft_dst=draft_dst, draft_src=draft_src,
                     draft_grid=draft_grid)


def loop_rows(allocator: BlockAllocator, roots: list[Span], write_limits: list[int],
              num_steps: int) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Host lists [S][B] (positions, slots, seq_lens) of a one-token-per-request draft loop:
    step j (1-based) of request b sits at ``roots[b].start + roots[b].length - 1 + j``;
    positions at or past the request's write limit are inert (as in ``Span``)."""
    positions = [[0] * len(roots) for _ in range(num_steps)]
    slots = [[0] * len(roots) for _ in range(num_steps)]
    lens = [[0] * len(roots) for _ in range(num_steps)]
    page, tables = allocator.page_size, allocator.tables
    for b, (s, limit) in enumerate(zip(roots, write_limits)):
        table = tables[s.req_id]
        for j in range(num_steps):
            p = s.start + s.length + j
            if p < limit:
                positions[j][b], slots[j][b] = p, table[p // page] * page + p % page
            else:
                positions[j][b], slots[j][b] = limit - 1, -1
            lens[j][b] = positions[j][b] + 1
    return positions, slots, lens


def build_metadata(allocator: BlockAllocator, spans: list[Span],
                   device: torch.device) -> tuple[torch.Tensor, AttentionMetadata]:
    """Returns positions [num_tokens] int64 and the metadata for the flat batch of ``spans``."""
    return _host_metadata_to_device(build_host_batch(allocator, spans, []), device)


def build_host_batch(allocator: BlockAllocator, spans: list[Span], input_ids: list[int],
                     draft_dst: list[int] = (), draft_src: list[int] = ()) -> HostBatch:
    """The flat batch of ``spans`` as host lists (no device work: ``host_batch_to_device`` or a
    graph's ``run_host`` takes it from here)."""
    positions, slots, seq_lens, qsl = span_rows(allocator, spans)
    return HostBatch(input_ids=input_ids, positions=positions, slots=slots, seq_lens=seq_lens,
                     query_start_loc=qsl, tables=[allocator.tables[s.req_id] for s in spans],
                     max_query_len=max(s.length for s in spans), max_seq_len=int(max(seq_lens)),
                     draft_dst=list(draft_dst), draft_src=list(draft_src))


def host_batch_to_device(hb: HostBatch, device: torch.device,
                         drafts_flat: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids [T], positions [T], metadata) on ``device``; draft rows filled on device."""
    positions, meta = _host_metadata_to_device(hb, device)
    input_ids = to_device(hb.input_ids, device)  # [T]
    if len(hb.draft_dst):  # drafts flat, or 2-D (``HostBatch.draft_grid``): src is flat
        input_ids[to_device(hb.draft_dst, device)] = drafts_flat.reshape(-1)[
            to_device(hb.draft_src, device)]
    return input_ids, positions, meta


def _host_metadata_to_device(hb: HostBatch, device: torch.device
                             ) -> tuple[torch.Tensor, AttentionMetadata]:
    return metadata_to_device(device, hb.positions, hb.slots, hb.seq_lens, hb.query_start_loc,
                              hb.tables, hb.max_query_len, hb.max_seq_len)


def build_loop_metadata(allocator: BlockAllocator, roots: list[Span], write_limits: list[int],
                        num_steps: int, device: torch.device
                        ) -> tuple[torch.Tensor, AttentionMetadata]:
    """Metadata of a whole draft loop at once (``loop_rows``): positions [S, B] and metadata
    whose slot_mapping / seq_lens are [S, B] (``capture.pad.LiveBatch``'s loop layout); block
    tables must already cover every step's position (the proposer grows them first)."""
    positions, slots, lens = loop_rows(allocator, roots, write_limits, num_steps)
    return metadata_to_device(device, positions, slots, lens, list(range(len(roots) + 1)),
                              [allocator.tables[s.req_id] for s in roots], 1,
                              max(max(row) for row in lens))


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.from_numpy(np.array(values, dtype=np.int64))  # faster than torch.tensor(list)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def build_sampling_tensors(reqs: list[Request], device: torch.device,
                           repeat: int | list[int] = 1) -> SamplingTensors:
    """Per-row parameters; ``repeat`` copies each request's row for its verification slots (one
    count for all, or one per request)."""
    counts = [repeat] * len(reqs) if isinstance(repeat, int) else repeat  # [B] rows each
    reps = np.asarray(counts, dtype=np.int64)
    params = [r.params for r in reqs]

    def t(vals: list, dtype: np.dtype) -> torch.Tensor:  # one value per request -> per row
        # Through numpy: ~3x faster than torch.tensor(list) at a thousand rows per step; and
        # not blocking (as to_device), so the host does not wait here for the step's forward.
        # Repeated there, not as Python lists of every row (k + 1 per request in a verify).
        rows = np.repeat(np.array(vals, dtype=dtype), reps)
        return torch.from_numpy(rows).to(device, non_blocking=True)

    live = [p for p, n in zip(params, counts) if n]  # the requests with rows
    return SamplingTensors(
        temperature=t([p.temperature for p in params], np.float32),
        top_k=t([p.top_k for p in params], np.int64),
        top_p=t([p.top_p for p in params], np.float32),
        min_p=t([p.min_p for p in params], np.float32),
        seeds=t([r.seed for r in reqs], np.int64),
        all_greedy=all(p.greedy for p in live),
        any_sorting=any(p.needs_sorting for p in live),
        any_min_p=any(p.min_p > 0 and not p.greedy for p in live),
    )


def verify_logits(compute_logits: Callable[[torch.Tensor], torch.Tensor],
                  hidden: torch.Tensor,  # [T, h] the step's target rows
                  spans: list[Span], num_draft: list[int], device: torch.device,
                  ) -> tuple[torch.Tensor, list[int]]:
    """Target logits for each request's last k_i + 1 query tokens, padded: ([B, K+1, V], the
    first flat row of each request)."""
    kmax = max(num_draft)
    lengths = [s.length for s in spans]
    row_start = list(accumulate(lengths[:-1], initial=0))
    # Decode and full verification (every row wanted, every request verifying kmax drafts)
    # need no gathers: no index lists, copies or kernels on the step's host-bound path.
    every_row = lengths == [k_i + 1 for k_i in num_draft]
    same_k = num_draft.count(kmax) == len(num_draft)
    if every_row and same_k:
        return compute_logits(hidden).view(len(spans), kmax + 1, -1), row_start
    if not every_row:  # prefill rows in the batch: keep each request's last k_i + 1
        rows: list[int] = []
        for n, k_i, r0 in zip(lengths, num_draft, row_start):
            rows.extend(range(r0 + n - k_i - 1, r0 + n))
        hidden = hidden[to_device(rows, device)]
    logits = compute_logits(hidden)  # [R, V]
    if not same_k:  # fewer drafts for some requests: repeat their last row up to kmax + 1
        pad_idx: list[int] = []
        base = 0  # first of the request's k_i + 1 rows in logits
        for k_i in num_draft:
            pad_idx.extend(base + min(j, k_i) for j in range(kmax + 1))
            base += k_i + 1
        logits = logits[to_device(pad_idx, device)]
    return logits.view(len(spans), kmax + 1, -1), row_start
