"""capture.buffer_writes: a compiled function stores its results in a graph's static buffers
(the early tree step's layouts into the late graphs' buffers), at the views' places, the rest
untouched, eager and compiled alike, and compiled once for every batch size (the largest
batch's [S, T] view is contiguous, the others' are not)."""
import pytest
import torch

from capture.buffer_writes import Region, region, write_regions
from capture.pad import StaticBuffers

S, T, B, W = 2, 12, 4, 3  # steps, max tokens, max seqs, block-table width


def _bufs() -> StaticBuffers:
    return StaticBuffers(T, B, W, "cpu", num_steps=S)


def _views(bufs: StaticBuffers, b: int):
    v = bufs._views(3 * b, b, 3, 64)
    return (v.input_ids, v.positions, v.meta.seq_lens, v.meta.query_start_loc,
            v.meta.block_tables)


def _values(b: int):
    t = 3 * b
    return (torch.arange(100, 100 + t),  # ids [t]
            torch.arange(200, 200 + S * t).view(S, b, 3),  # positions, as [S, b, K]
            torch.arange(300, 300 + S * b).view(S, b),  # seq_lens [S, b], to int32
            torch.arange(b + 1) * 3,  # query starts [b+1]
            torch.arange(b * W, dtype=torch.int32).view(b, W) + 7)  # tables [b, W]


STEPS = (False, True, True, False, False)  # which of _views' are per-step [S, n] rows


def _regions(bufs, views, first_flat=0):
    return [region(bufs, v, first_flat, steps) for v, steps in zip(views, STEPS)]


def test_regions_are_the_views_places():
    bufs = _bufs()
    regs = _regions(bufs, _views(bufs, 2), first_flat=2)
    assert regs[0] == Region(2, 0, 0)  # input_ids: the int64 buffer's start, flat
    assert regs[1] == Region(2, 3 * T, T)  # positions [S, t]: rows T apart
    assert regs[2] == Region(3, 0, B)  # seq_lens [S, b] in the int32 buffer, rows B apart
    assert regs[3] == Region(3, S * B, 0)
    assert regs[4] == Region(3, S * B + B + 1, 0)  # [b, W] block tables: contiguous, flat
    # the same places at the largest batch, whose [S, T] views are contiguous
    assert _regions(bufs, _views(bufs, B), 2) == regs
    with pytest.raises(ValueError, match="not in these buffers"):
        region(bufs, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="not contiguous"):
        region(bufs, _views(bufs, 2)[1])  # per-step rows, not said so


@pytest.mark.parametrize("compiled", [False, True])
def test_values_land_in_the_views_and_nowhere_else(compiled):
    from torch._inductor.compile_fx import compile_fx

    bufs = _bufs()
    regs = tuple(_regions(bufs, _views(bufs, 2)))
    graphs = []

    def backend(gm, example_inputs):  # Inductor, counting its graphs
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    class Writer(torch.nn.Module):  # the regions as module state, as EarlyTreeStage holds them
        def forward(self, flats, values):
            write_regions(flats, self.regions, values)

    writer = Writer()
    writer.regions = regs
    run = torch.compile(writer, backend=backend, dynamic=True) if compiled else writer
    for b in (2, B, 1):
        bufs.flat64.fill_(-5)
        bufs.flat32.fill_(-5)
        vals = _values(b)
        # the engine's compile settings: size 1 stays symbolic (compiled_spec/compile.py)
        with torch.fx.experimental._config.patch(use_duck_shape=False,
                                                 backed_size_oblivious=True):
            run((bufs.flat64, bufs.flat32), vals)
        ids, pos, lens, qsl, tables = _views(bufs, b)
        assert torch.equal(ids, vals[0])
        assert torch.equal(pos, vals[1].reshape(S, -1))
        assert torch.equal(lens, vals[2].to(torch.int32))
        assert torch.equal(qsl, vals[3].to(torch.int32))
        assert torch.equal(tables, vals[4])
        written = 3 * b + S * 3 * b
        assert (bufs.flat64 == -5).sum() == bufs.flat64.numel() - written
        assert (bufs.flat32 == -5).sum() == bufs.flat32.numel() - (S * b + b + 1 + b * W)
    if compiled:  # one graph for every batch size, the largest (contiguous views) among them
        assert len(graphs) == 1, [str(g.graph) for g in graphs]
