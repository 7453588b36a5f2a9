"""Row sources (``StaticBuffers(row_sources=...)``): an extra whose rows the captured graph
gathers itself by int64 ``rows`` staged with the batch's other integers, as the tree first pass
reads the accepted target rows. Checked through emulated graphs (``capture.emulate``): the
host-staged and the device-tensor paths give what the eager gather gives, padded tokens read a
valid row, and a source larger than its buffer is a counted miss."""
from __future__ import annotations

import pytest
import torch

from capture import LiveBatch, StaticBuffers
from capture.emulate import EmulatedGraphRunner
from capture.host_stage import HostBatch
from compiled_spec.engine.batch import host_batch_to_device, to_device

CPU = torch.device("cpu")
Q, SRC_ROWS, H = 3, 10, 4  # query_len of the graphs, rows of the source buffer, row width


def _gather(b: LiveBatch) -> torch.Tensor:  # [T, H]: each token's source row, tagged by position
    return b.extras["src"].index_select(0, b.rows) + 1000 * b.positions[:, None]


def _runner() -> EmulatedGraphRunner:
    bufs = StaticBuffers(2 * Q, 2, 4, CPU, row_sources={"src": (SRC_ROWS, (H,), torch.float32)})
    runner = EmulatedGraphRunner("first_pass", _gather, [Q, 2 * Q], bufs, seq_len_buckets=(64,),
                                 query_len=Q)
    runner.capture()
    return runner


def _batch(rows: list[list[int]]) -> HostBatch:
    """One sequence per entry of ``rows`` (its tokens' source rows), positions 5, 6, ..."""
    n = [len(r) for r in rows]
    qsl = [sum(n[:i]) for i in range(len(n) + 1)]
    pos = [5 + j for m in n for j in range(m)]
    return HostBatch(input_ids=[1] * qsl[-1], positions=pos, slots=[-1] * qsl[-1],
                     seq_lens=[5 + m for m in n], query_start_loc=qsl,
                     tables=[[i] for i in range(len(n))], max_query_len=max(n),
                     max_seq_len=5 + max(n), rows=[r for seq in rows for r in seq])


def _want(hb: HostBatch, src: torch.Tensor) -> torch.Tensor:
    return src[hb.rows] + 1000 * torch.tensor(hb.positions, dtype=torch.float32)[:, None]


def test_host_staged_rows_are_gathered_in_the_graph():
    runner = _runner()
    src = torch.randn(7, H)  # fewer rows than the buffer: the rest is never read
    # Not contiguous, not sorted, a row twice; then a smaller batch after the larger one.
    for rows in ([[6, 0, 3], [5, 5]], [[2], [4, 1]], [[3]]):
        hb = _batch(rows)
        out = runner.run_host(hb, None, {"src": src})
        assert torch.equal(out, _want(hb, src)), rows
        # Padded tokens read row 0: a valid row of any source.
        padded = runner.buffers.rows[:2 * Q if len(rows) > 1 else Q]
        assert padded[len(hb.rows):].eq(0).all()
    assert runner.stats()["graph_replays"] == 3


def test_device_tensor_path_equals_the_host_staged_one():
    runner = _runner()
    src = torch.randn(SRC_ROWS, H)
    hb = _batch([[9, 1], [0, 8, 2]])
    ids, pos, meta = host_batch_to_device(hb, CPU)
    live = LiveBatch(ids, pos, meta, extras={"src": src}, rows=to_device(hb.rows, CPU))
    assert torch.equal(runner.run(live), _want(hb, src))
    assert torch.equal(runner.run_host(hb, None, {"src": src}), _want(hb, src))
    assert runner.stats()["graph_replays"] == 2


def test_a_source_larger_than_its_buffer_is_a_counted_miss():
    runner = _runner()
    hb = _batch([[0, 11]])
    big = torch.randn(SRC_ROWS + 2, H)
    assert runner.run_host(hb, None, {"src": big}) is None  # the caller runs the body itself
    ids, pos, meta = host_batch_to_device(hb, CPU)
    live = LiveBatch(ids, pos, meta, extras={"src": big}, rows=to_device(hb.rows, CPU))
    assert torch.equal(runner.run(live), _want(hb, big))  # the body, without a graph
    st = runner.stats()
    assert st["fallback_reasons"] == {"source_rows": 2} and st["graph_replays"] == 0


def test_rows_must_match_the_buffers():
    runner = _runner()
    hb = _batch([[0, 1]])
    hb.rows = hb.rows[:1]
    with pytest.raises(ValueError, match="rows"):
        runner.run_host(hb, None, {"src": torch.zeros(2, H)})
    plain = StaticBuffers(Q, 1, 4, CPU)
    assert plain.rows is None and plain.lead == 3  # no rows segment without row sources
    ids, pos, meta = host_batch_to_device(_batch([[0]]), CPU)
    with pytest.raises(ValueError, match="rows"):
        plain.fill(LiveBatch(ids, pos, meta, rows=torch.zeros(1, dtype=torch.int64)), Q, 1, Q,
                   64)
