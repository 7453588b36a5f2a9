"""Host-side batch construction, the engine's per-step hot path: the inlined slot arithmetic of
``span_rows`` / ``loop_rows`` against the allocator's own ``slot()``, inert rows past write
limits included, and ``Request.tokens`` against slicing the whole token list."""
from __future__ import annotations

import random

import pytest
import torch

from compiled_spec.engine.batch import (SPAN_ROWS_NUMPY, Span, build_chain_batch, chain_rows,
                                        loop_rows, span_rows, span_rows_np)
from compiled_spec.engine.request import Request
from compiled_spec.kv_cache import BlockAllocator
from compiled_spec.sampling_params import SamplingParams


def _span_rows_ref(alloc: BlockAllocator, spans: list[Span]):
    positions, slots, seq_lens, qsl = [], [], [], [0]
    for s in spans:
        limit = s.start + s.length if s.write_limit is None else s.write_limit
        for p in range(s.start, s.start + s.length):
            if p < limit:
                positions.append(p)
                slots.append(alloc.slot(s.req_id, p))
            else:
                positions.append(limit - 1)
                slots.append(-1)
        seq_lens.append(positions[-1] + 1 if s.length else s.start)
        qsl.append(qsl[-1] + s.length)
    return positions, slots, seq_lens, qsl


def test_span_and_loop_rows_match_the_allocator():
    rng = random.Random(0)
    for page in (1, 4, 16):
        alloc = BlockAllocator(4000, page)
        for r in range(12):
            alloc.grow(r, 200)
        for _ in range(600):
            spans = []
            for r in rng.sample(range(12), rng.randint(1, 6)):
                start, length = rng.randint(0, 180), rng.randint(0, 12)
                limit = rng.choice([None, max(1, start + rng.randint(-3, length + 2))])
                spans.append(Span(r, start, length, limit))
            assert span_rows(alloc, spans) == _span_rows_ref(alloc, spans), spans
            roots = [Span(s.req_id, s.start, max(1, s.length)) for s in spans]
            limits = [s.start + s.length + rng.randint(0, 5) for s in roots]
            pos, slots, lens = loop_rows(alloc, roots, limits, 4)
            for b, (s, lim) in enumerate(zip(roots, limits)):
                for j in range(4):
                    p = s.start + s.length + j
                    want = (p, alloc.slot(s.req_id, p)) if p < lim else (lim - 1, -1)
                    assert (pos[j][b], slots[j][b]) == want and lens[j][b] == want[0] + 1


def test_span_rows_numpy_equals_the_loop():
    """Prompt steps (many rows) take the vectorised ``span_rows_np``: the same rows as the
    reference for spans of any length (0 included), write limits inside, at and before a span
    (all inert: no table read), tables of different widths; a live row past its table raises."""
    rng = random.Random(2)
    paths = set()
    for page in (1, 4, 16):
        alloc = BlockAllocator(4000, page)
        for r in range(12):
            alloc.grow(r, 60 + 12 * r)
        for _ in range(300):
            spans = []
            for r in rng.sample(range(12), rng.randint(1, 12)):
                length = rng.choice([0, 1, rng.randint(2, 60), rng.randint(40, 60)])
                start = rng.randint(0, 60 + 12 * r - length)
                limit = rng.choice([None, max(1, start + rng.randint(-3, length + 2))])
                spans.append(Span(r, start, length, limit))
            want = _span_rows_ref(alloc, spans)
            got = span_rows_np(alloc, spans)
            assert [a.tolist() for a in got] == list(want), spans
            # span_rows hands batches of SPAN_ROWS_NUMPY rows and more to it
            out = span_rows(alloc, spans)
            big = sum(s.length for s in spans) >= SPAN_ROWS_NUMPY
            assert isinstance(out[0], list) != big and [list(a) for a in out] == list(want)
            paths.add(big)
    assert paths == {False, True}  # both ways were compared
    alloc = BlockAllocator(100, 4)
    alloc.grow(0, 8)
    with pytest.raises(IndexError):
        span_rows_np(alloc, [Span(0, 6, 4)])  # rows 8 and 9 have no block


def test_span_rows_numpy_of_one_length_equals_the_loop(monkeypatch):
    """Spans of one length without write limits (a paused engine's flush) take a grid path of
    their own in ``span_rows_np``: the reference's rows, and its IndexError past a table; a
    write limit anywhere, or one span of another length, takes the general path, same rows."""
    from compiled_spec.engine import batch as bt

    grid, real = [], bt._uniform_rows
    monkeypatch.setattr(bt, "_uniform_rows", lambda *a: grid.append(1) or real(*a))
    rng = random.Random(5)
    for page in (1, 4, 16):
        alloc = BlockAllocator(4000, page)
        for r in range(64):
            alloc.grow(r, 40 + r % 7)
        for _ in range(50):
            q = rng.randint(1, 32)
            reqs = rng.sample(range(64), rng.randint(1, 64))
            spans = [Span(r, rng.randint(0, 40 - q), q) for r in reqs]
            if rng.random() < 0.3:  # a write limit on one span, or a span one shorter
                i = rng.randrange(len(spans))
                sp = spans[i]
                spans[i] = (Span(sp.req_id, sp.start, sp.length, sp.start + q - 1)
                            if rng.random() < 0.5 or q == 1 else Span(sp.req_id, sp.start, q - 1))
            got = span_rows_np(alloc, spans)
            assert [a.tolist() for a in got] == list(_span_rows_ref(alloc, spans)), spans
    assert 60 < len(grid) < 150  # of 150 batches: both paths compared
    with pytest.raises(IndexError):  # the second span's last row has no block
        span_rows_np(alloc, [Span(0, 0, 4), Span(1, 45, 4)])  # 41 tokens: 3 blocks of 16


def test_chain_rows_equal_span_rows():
    """The vectorised rows of a chain step (spans of one length) are ``span_rows``' for the same
    spans: tables of different widths, write limits inside, at and before a span (all inert)."""
    rng = random.Random(1)
    for page in (1, 4, 16):
        alloc = BlockAllocator(4000, page)
        for r in range(12):
            alloc.grow(r, 60 + 12 * r)  # tables of different widths
        for _ in range(300):
            q = rng.randint(1, 7)
            reqs = rng.sample(range(12), rng.randint(1, 8))
            starts = [rng.randint(0, 60 + 12 * r - q) for r in reqs]
            limited = rng.random() < 0.5
            limits = [max(1, s + rng.randint(-3, q + 2)) for s in starts] if limited else None
            spans = [Span(r, st, q, None if limits is None else lim)
                     for r, st, lim in zip(reqs, starts, limits or starts)]
            pos, slots, lens, qsl = span_rows(alloc, spans)
            tables = [alloc.tables[r] for r in reqs]
            got = chain_rows(tables, page, starts, limits, q)
            assert (got[0].tolist(), got[1].tolist(), got[2].tolist()) == (pos, slots, lens)
            hb = build_chain_batch(alloc, reqs, starts, limits, q, [0] * len(pos), [], [])
            assert list(hb.query_start_loc) == qsl and hb.max_seq_len == max(lens)
            assert hb.num_tokens == len(pos) and hb.num_seqs == len(reqs) and hb.num_steps == 1


def test_request_tokens_equals_slicing_the_whole_sequence():
    req = Request(req_id=0, prompt_token_ids=[1, 2, 3, 4], params=SamplingParams(), seed=0,
                  max_total_tokens=20)
    req.output_token_ids.extend([5, 6, 7])
    for start in range(8):
        for end in range(start, 9):
            assert req.tokens(start, end) == req.token_ids[start:end], (start, end)


def test_requests_compare_by_identity_in_the_scheduler_queues():
    """Two requests with equal fields are different requests: removing one from a queue must
    not remove the other (value equality also made every ``remove`` compare token lists)."""
    from compiled_spec.engine.scheduler import Scheduler
    from compiled_spec.config import SchedulerConfig

    sp = SamplingParams(max_tokens=4)
    a, b = (Request(7, [1, 2, 3], sp, 0, 7) for _ in range(2))
    assert a != b and a == a
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
                      BlockAllocator(8, 4))
    sched.running.extend([a, b])
    sched.finish(b, "stop")
    assert sched.running == [a] and sched.running[0] is a


@pytest.mark.parametrize("num_tokens, tables", [
    (1, [[3]]), (7, [[1, 2], [4]]), (6, [[1, 2, 3], [4], [5, 6]]), (13, [[9]] * 5)])
def test_metadata_views_are_16_byte_aligned_and_hold_the_lists(num_tokens, tables):
    """Triton compiles one binary per pointer alignment: views at count-dependent offsets of
    one staging buffer made prompt steps JIT-compile kernels start-up had compiled (H200)."""
    from compiled_spec.engine.batch import metadata_to_device

    b = len(tables)
    positions = list(range(10, 10 + num_tokens))
    slots = list(range(100, 100 + num_tokens))
    lens = [len(t) * 4 for t in tables]
    qsl = sorted(range(b + 1))
    pos, meta = metadata_to_device(torch.device("cpu"), positions, slots, lens, qsl, tables, 3,
                                   max(lens))
    for t in (pos, meta.slot_mapping, meta.seq_lens, meta.query_start_loc, meta.block_tables):
        assert t.storage_offset() * t.element_size() % 16 == 0, t
    assert pos.tolist() == positions and meta.slot_mapping.tolist() == slots
    assert meta.seq_lens.tolist() == lens and meta.query_start_loc.tolist() == qsl
    width = max(2, max(map(len, tables)))
    assert meta.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    # the loop layout ([S, B] positions, slots and lens) keeps its shape
    pos2, meta2 = metadata_to_device(torch.device("cpu"), [[1, 2, 3]] * 3, [[4, 5, 6]] * 3,
                                     [[7, 8, 9]] * 3, [0, 1, 2, 3], [[1], [2], [3]], 1, 9)
    assert pos2.shape == (3, 3) and meta2.slot_mapping.tolist() == [[4, 5, 6]] * 3
    assert meta2.seq_lens.shape == (3, 3)
    assert meta2.slot_mapping.storage_offset() * 8 % 16 == 0
