"""CPU tests of the CUDA-graph layer: size policy, inert padding, static buffers, GraphRunner's
CPU fallback and (through a stand-in for CUDAGraph) its pad / replay / slice path."""
from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from capture import (CaptureError, CapturePolicy, GraphRegistry, GraphRunner, LiveBatch,
                     StaticBuffers, assert_captured, bucket_max_seq_len, decode_sizes,
                     default_batch_sizes, draft_step_sizes, mixed_sizes, pad_batch, pad_to,
                     padding_table, prefill_sizes, verify_sizes)
from capture.emulate import EmulatedGraphRunner
from capture.selfcheck_cuda import TinyModel, live_batch, make_world

CPU = torch.device("cpu")


# ---- policy --------------------------------------------------------------------------------
def test_default_batch_sizes_like_vllm():
    assert default_batch_sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert default_batch_sizes(10) == (1, 2, 4, 8, 10)  # the max itself always gets a graph
    assert default_batch_sizes(1) == (1,)
    assert default_batch_sizes(3) == (1, 2, 3)


def test_policy_sizes():
    p = CapturePolicy(max_batch_size=16, num_speculative_tokens=3, max_model_len=2048)
    assert p.batch_sizes == (1, 2, 4, 8, 16) and p.seq_len_buckets == (2048,)
    assert decode_sizes(p) == [1, 2, 4, 8, 16] == draft_step_sizes(p)
    assert verify_sizes(p) == [4, 8, 16, 32, 64]
    q = CapturePolicy(8, 0, 512, batch_sizes=(4, 1, 4, 2), seq_len_buckets=(512, 128))
    assert q.batch_sizes == (1, 2, 4) and q.seq_len_buckets == (128, 512)  # normalised
    assert verify_sizes(q) == decode_sizes(q)  # k = 0: verify is decode
    # Chain engines: one request decoding replays the batch-1 verify graph, so no 1-token
    # graph (a target compile of its own: Dynamo specializes size-1 dimensions).
    assert decode_sizes(p, single_via_verify=True) == [2, 4, 8, 16]
    one = CapturePolicy(max_batch_size=1, num_speculative_tokens=5, max_model_len=512)
    assert decode_sizes(one, single_via_verify=True) == [] and verify_sizes(one) == [6]
    # k shrunk (an adaptive policy's adaptive_k): verify graphs of w + 1 rows per request
    w = CapturePolicy(16, 5, 2048, batch_sizes=(1, 4), verify_widths=(2, 1, 2))
    assert w.verify_widths == (1, 2) and verify_sizes(w) == [6, 24]
    assert verify_sizes(w, 1) == [2, 8] and verify_sizes(w, 2) == [3, 12]
    with pytest.raises(ValueError, match="verify width 3"):
        verify_sizes(w, 3)


def test_prefill_sizes():
    """One-sequence prompt-step graphs: powers of two above the verify's k + 1 tokens, up to
    the cap (kept when it is no power of two); nothing for a cap the verify graph covers."""
    assert prefill_sizes(512, 6) == (16, 32, 64, 128, 256, 512)
    assert prefill_sizes(300, 6) == (16, 32, 64, 128, 256, 300)
    assert prefill_sizes(16, 1) == (16,) and prefill_sizes(10, 1) == (10,)
    assert prefill_sizes(64, 20) == (32, 64)  # k + 1 = 20: the verify graph serves <= 20
    assert prefill_sizes(0, 6) == () == prefill_sizes(6, 6)
    with pytest.raises(ValueError, match="negative"):
        prefill_sizes(-1, 6)
    p = CapturePolicy(4, 3, 128, prefill_sizes=(64, 16, 16))
    assert p.prefill_sizes == (16, 64) and CapturePolicy(4, 3, 128).prefill_sizes == ()


def test_mixed_sizes():
    """Varlen prompt-step graphs: powers of two from 128 up to the cap (kept when it is no power
    of two); nothing below the smallest. The policy validates its baked query length."""
    assert mixed_sizes(4096) == (128, 256, 512, 1024, 2048, 4096)
    assert mixed_sizes(600) == (128, 256, 512, 600)
    assert mixed_sizes(128) == (128,) and mixed_sizes(127) == () == mixed_sizes(0)
    assert mixed_sizes(100, smallest=16) == (16, 32, 64, 100)
    with pytest.raises(ValueError, match="negative"):
        mixed_sizes(-1)
    p = CapturePolicy(4, 3, 128, mixed_sizes=(128, 64), mixed_query_len=32)
    assert p.mixed_sizes == (64, 128)
    for q in (0, 129, True):
        with pytest.raises(ValueError, match="mixed_query_len"):
            CapturePolicy(4, 3, 256, mixed_sizes=(128,), mixed_query_len=q)


@pytest.mark.parametrize("kwargs", [
    dict(max_batch_size=0), dict(num_speculative_tokens=-1), dict(max_model_len=0),
    dict(num_speculative_tokens=True), dict(batch_sizes=(1, 32)), dict(batch_sizes=(0, 2)),
    dict(seq_len_buckets=(4096,)), dict(seq_len_buckets=(1.5,)),
    dict(prefill_sizes=(4096,)), dict(prefill_sizes=(0,)),
    dict(verify_widths=(3,)), dict(verify_widths=(0,)), dict(verify_widths=(True,)),
])
def test_policy_validation(kwargs):
    base = dict(max_batch_size=16, num_speculative_tokens=3, max_model_len=2048)
    with pytest.raises(ValueError):
        CapturePolicy(**{**base, **kwargs})


def test_policy_is_frozen():
    p = CapturePolicy(4, 1, 64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_batch_size = 8  # type: ignore[misc]


def test_pad_to_edges():
    sizes = [1, 2, 4, 8, 16]
    assert pad_to(0, sizes) == 0  # empty batch: nothing to pad, never replayed
    assert [pad_to(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16)] == [1, 2, 4, 8, 8, 16, 16]
    assert pad_to(17, sizes) is None  # above the largest: compiled, no graph
    with pytest.raises(ValueError):
        pad_to(-1, sizes)


def test_padding_table():
    sizes = [1, 2, 4, 8, 16, 24]
    table = padding_table(sizes)
    assert len(table) == 25 and table == [pad_to(n, sizes) for n in range(25)]
    assert padding_table([8, 2], 5) == [0, 2, 2, 8, 8, 8]  # unsorted input is fine
    with pytest.raises(ValueError):
        padding_table(sizes, 25)


def test_bucket_max_seq_len():
    p = CapturePolicy(4, 3, 4096, seq_len_buckets=(256, 1024, 4096))
    assert [bucket_max_seq_len(n, p) for n in (0, 1, 256, 257, 4096)] == [256, 256, 256, 1024,
                                                                          4096]
    assert bucket_max_seq_len(4097, p) is None
    assert bucket_max_seq_len(300, (128, 512)) == 512


# ---- padding -------------------------------------------------------------------------------
@pytest.fixture()
def world():
    torch.manual_seed(0)
    model = TinyModel(CPU, num_blocks=64, page_size=4, hidden=32, heads=4, kv_heads=2)
    ctx = [5, 9, 17, 3, 30, 12]
    alloc = make_world(model, ctx, lookahead=4)
    return model, alloc, ctx


def _batch(world, kind: str, n: int) -> LiveBatch:
    model, alloc, ctx = world
    reqs = list(range(n))
    q_lens = {"decode": [1] * n, "verify": [4] * n, "mixed": [1, 4, 2, 4, 3, 1][:n]}.get(kind,
                                                                                   [1] * n)
    return live_batch(model, alloc, reqs, [ctx[r] for r in reqs], q_lens,
                      steps=2 if kind == "draft" else 0)


def _assert_caches(model: TinyModel, ref_caches, snap, live: LiveBatch) -> None:
    """Live slots hold what the unpadded run wrote (up to matmul rounding: padding changes the
    GEMM's M); every other slot, the padding's included, is bit-for-bit untouched."""
    written = torch.zeros(model.caches[0][0].shape[:2], dtype=torch.bool)
    slots = live.meta.slot_mapping.reshape(-1)
    written.view(-1)[slots[slots >= 0]] = True
    for (k, v), (kr, vr), (ks, vs) in zip(model.caches, ref_caches, snap):
        for c, cr, cs in ((k, kr, ks), (v, vr, vs)):
            torch.testing.assert_close(c, cr, rtol=1e-5, atol=1e-5)
            assert torch.equal(c[~written], cs[~written])


@pytest.mark.parametrize("kind", ["decode", "verify", "mixed", "draft"])
def test_pad_batch_inert_rows(world, kind):
    live = _batch(world, kind, 3)
    t, b = live.num_tokens, live.num_seqs
    tp, bp = (8 if kind in ("decode", "draft") else 32), 8
    pad = pad_batch(live, tp, bp, max_query_len=4, max_seq_len=64, seq_extras=())
    m, lm = pad.meta, live.meta
    # live rows unchanged
    assert torch.equal(pad.input_ids[:t], live.input_ids)
    assert torch.equal(pad.positions[..., :t], live.positions)
    assert torch.equal(m.slot_mapping[..., :t], lm.slot_mapping)
    assert torch.equal(m.seq_lens[..., :b], lm.seq_lens)
    assert torch.equal(m.query_start_loc[:b + 1], lm.query_start_loc)
    assert torch.equal(m.block_tables[:b], lm.block_tables)
    # padded rows inert: no KV write, q_len 0, seq_len 0, valid dummy block 0, id / position 0
    assert (m.slot_mapping[..., t:] == -1).all() and (pad.input_ids[t:] == 0).all()
    assert (pad.positions[..., t:] == 0).all()
    assert (m.query_start_loc[b:] == t).all()  # q_len 0 for every padded sequence
    assert (m.seq_lens[..., b:] == 0).all() and (m.block_tables[b:] == 0).all()
    assert m.max_seq_len == 64 and m.max_query_len == 4  # the graph's host ints
    assert int(m.seq_lens.max()) == int(lm.seq_lens.max())  # padding never raises the max
    if kind == "draft":
        assert pad.extras["feed"].shape[0] == tp and (pad.extras["feed"][t:] == 0).all()


@pytest.mark.parametrize("kind", ["decode", "verify", "mixed"])
def test_padding_convention_with_reference_kernels(world, kind):
    """Padded rows write nothing into the KV cache and attend to nothing; live rows give the
    same result with the graph's (larger) host ints as with the live ones."""
    model = world[0]
    live = _batch(world, kind, 4)
    snap = [(k.clone(), v.clone()) for k, v in model.caches]
    ref = model.forward(live)
    ref_caches = [(k.clone(), v.clone()) for k, v in model.caches]
    for (k, v), (ks, vs) in zip(model.caches, snap):
        k.copy_(ks), v.copy_(vs)
    pad = pad_batch(live, 32, 8, max_query_len=4, max_seq_len=128)
    out = model.forward(pad)
    torch.testing.assert_close(out[:live.num_tokens], ref, rtol=1e-5, atol=1e-5)
    _assert_caches(model, ref_caches, snap, live)
    q = torch.randn(32, 4, 8)
    attn = torch.ops.compiled_spec.paged_attention(
        q, *model.caches[0], pad.meta.block_tables, pad.meta.seq_lens, pad.meta.query_start_loc,
        4, 128, 1.0)
    assert (attn[live.num_tokens:] == 0).all()  # rows owned by no sequence


def test_static_buffers_reused_and_refilled(world):
    bufs = StaticBuffers(32, 8, 16, CPU)
    ptrs = {n: getattr(bufs, n).data_ptr() for n in ("input_ids", "positions", "slot_mapping")}
    big, small = _batch(world, "verify", 5), _batch(world, "decode", 2)
    v1 = bufs.fill(big, 24, 6, 4, 64)
    v2 = bufs.fill(small, 8, 8, 4, 64)
    for v in (v1, v2):
        assert v.input_ids.data_ptr() == ptrs["input_ids"]
        assert v.positions.data_ptr() == ptrs["positions"]
        assert v.meta.slot_mapping.data_ptr() == ptrs["slot_mapping"]
        assert v.meta.block_tables.data_ptr() == bufs.block_tables.data_ptr()
        assert v.meta.block_tables.stride() == bufs.block_tables.stride()  # full width kept
    # the second fill leaves nothing of the first in its rows
    ref = pad_batch(small, 8, 8, 4, 64)
    assert torch.equal(v2.meta.slot_mapping, ref.meta.slot_mapping)
    assert torch.equal(v2.meta.query_start_loc, ref.meta.query_start_loc)
    assert torch.equal(v2.meta.seq_lens, ref.meta.seq_lens)
    assert torch.equal(v2.meta.block_tables[:, :ref.meta.block_tables.shape[1]],
                       ref.meta.block_tables) and (v2.meta.block_tables[:, 8:] == 0).all()
    with pytest.raises(ValueError):
        bufs.fill(big, 40, 8, 4, 64)  # above the buffers
    with pytest.raises(ValueError):
        bufs.fill(big, 24, 6, 1, 64)  # host int below the live max_query_len


def test_static_buffers_loop_steps(world):
    live = _batch(world, "draft", 3)
    bufs = StaticBuffers(8, 8, 16, CPU, num_steps=2, token_extras={"feed": ((32,), torch.float32)})
    v = bufs.fill(live, 4, 4, 1, 64)
    assert v.positions.shape == (2, 4) and v.meta.seq_lens.shape == (2, 4)
    for j in range(2):
        pos, meta = v.step(j)
        lpos, lmeta = live.step(j)
        assert torch.equal(pos[:3], lpos) and pos[3] == 0
        assert torch.equal(meta.slot_mapping[:3], lmeta.slot_mapping) and meta.slot_mapping[3] == -1
        assert torch.equal(meta.seq_lens[:3], lmeta.seq_lens) and meta.seq_lens[3] == 0
        assert pos.data_ptr() == bufs.positions[j].data_ptr()
    assert torch.equal(live.step(1)[0], live.step(0)[0] + 1)  # positions +1 per step
    dummy = bufs.fill_dummy(8, 8, 1, 64)
    assert (dummy.meta.slot_mapping == -1).all()  # dummy runs never write the KV cache


# ---- GraphRunner ---------------------------------------------------------------------------
def test_graph_runner_cpu_falls_back_and_counts(world):
    calls = []

    def fn(b: LiveBatch) -> torch.Tensor:
        calls.append(b.num_tokens)
        return b.input_ids * 2

    runner = GraphRunner("decode", fn, [1, 2, 4], StaticBuffers(4, 4, 16, CPU),
                         seq_len_buckets=(64,))
    runner.capture()  # no-op on the CPU
    live = _batch(world, "decode", 3)
    assert torch.equal(runner.run(live), live.input_ids * 2)
    runner.run(live)
    st = runner.stats()
    assert calls == [3, 3] and not runner.enabled
    assert st["eager_fallbacks"] == 2 and st["graph_replays"] == 0 and st["padded_rows"] == 0
    assert st["captured_sizes"] == [] and st["capture_failures"] == []
    assert st["fallback_reasons"] == {"cpu": 2}


def test_assert_captured_raises():
    reg = GraphRegistry(CPU)
    reg.register("target_decode", lambda b: b.input_ids, [1, 2], StaticBuffers(2, 2, 4, CPU),
                 seq_len_buckets=(64,))
    with pytest.raises(CaptureError, match="never registered"):
        reg.assert_captured("draft_loop")  # the seeds/003 bug: the draft left out of capture
    with pytest.raises(CaptureError, match="zero captured"):
        reg.assert_captured("target_decode")
    reg.runners["target_decode"]._graphs[(1, 64)] = (None, None)  # as if captured
    reg.assert_captured("target_decode")
    assert_captured(reg.runners)  # all registered
    with pytest.raises(CaptureError):
        assert_captured(reg.runners, "target_decode", "target_verify")


CpuReplayRunner = EmulatedGraphRunner


@pytest.mark.parametrize("kind,n", [("decode", 3), ("decode", 6), ("verify", 3), ("mixed", 5),
                                    ("draft", 3), ("draft", 4)])
def test_replay_path_matches_eager(world, kind, n):
    model = world[0]
    q = 4 if kind in ("verify", "mixed") else 1
    loop = kind == "draft"
    bufs = StaticBuffers(8 * q, 8, 16, CPU, num_steps=2 if loop else 1,
                         token_extras={"feed": ((32,), torch.float32)} if loop else None)
    runner = CpuReplayRunner(kind, model.draft_loop if loop else model.forward,
                             [s * q for s in (1, 2, 4)], bufs, query_len=q,
                             seq_len_buckets=(16, 64), output_rows="seqs" if loop else "tokens")
    runner.capture()
    assert runner.captured_sizes == [q, 2 * q, 4 * q]
    live = _batch(world, kind, n)
    snap = [(k.clone(), v.clone()) for k, v in model.caches]
    ref = (model.draft_loop if loop else model.forward)(live)
    ref_caches = [(k.clone(), v.clone()) for k, v in model.caches]
    for (k, v), (ks, vs) in zip(model.caches, snap):
        k.copy_(ks), v.copy_(vs)
    out = runner.run(live)
    st = runner.stats()
    if n <= 4:
        size = pad_to(n, [1, 2, 4]) * q
        assert st["graph_replays"] == 1 and st["eager_fallbacks"] == 0
        assert st["padded_rows"] == size - live.num_tokens
        bucket = bucket_max_seq_len(live.meta.max_seq_len, (16, 64))
        assert out.data_ptr() == runner._graphs[(size, bucket)][1].data_ptr()  # a static view
    else:
        assert st["eager_fallbacks"] == 1 and st["fallback_reasons"] == {"size": 1}
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    _assert_caches(model, ref_caches, snap, live)  # padding wrote nothing


def _compiler_assert(n: int) -> None:
    assert n != 4  # the kind of failure a compiler raises: an assertion with no message


def test_capture_failure_recorded_and_strict(world):
    def fn(b: LiveBatch) -> torch.Tensor:
        if b.num_tokens == 4:
            try:
                _compiler_assert(b.num_tokens)
            except AssertionError as e:  # wrapped, as Inductor wraps its errors
                raise RuntimeError("boom") from e
        return b.input_ids + 1

    runner = CpuReplayRunner("verify", fn, [1, 2, 4], StaticBuffers(4, 4, 16, CPU),
                             seq_len_buckets=(64,))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        runner.capture()
    assert any("boom" in str(x.message) for x in w)
    st = runner.stats()
    assert st["captured_sizes"] == [1, 2] and len(st["capture_failures"]) == 1
    assert st["capture_failures"][0]["size"] == 4 and "boom" in st["capture_failures"][0]["error"]
    # The record names the innermost cause and where it was raised: an empty assertion
    # message inside a compiler's wrapper is otherwise undiagnosable from a remote log.
    why = st["capture_failures"][0]["error"]
    assert "<- AssertionError" in why and "test_capture.py" in why, why
    assert "in _compiler_assert: assert n != 4" in why, why
    live = _batch(world, "decode", 3)  # 3 would pad to the failed size 4: no graph -> counted
    assert torch.equal(runner.run(live), live.input_ids + 1)
    assert runner.stats()["fallback_reasons"] == {"size": 1}
    strict = CpuReplayRunner("v", fn, [4], StaticBuffers(4, 4, 16, CPU), seq_len_buckets=(64,),
                             strict=True)
    with pytest.raises(CaptureError, match="boom"):
        strict.capture()


def test_failed_bucket_falls_through_to_a_larger_one(world):
    def fn(b: LiveBatch) -> torch.Tensor:
        if b.meta.max_seq_len == 16:
            raise RuntimeError("no graph at 16")
        return b.input_ids + 1

    runner = CpuReplayRunner("decode", fn, [1, 2], StaticBuffers(2, 2, 16, CPU),
                             seq_len_buckets=(16, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runner.capture()
    live = _batch(world, "decode", 1)  # seq_len 6: bucket 16 failed, bucket 64 is still valid
    assert live.meta.max_seq_len <= 16
    assert torch.equal(runner.run(live), live.input_ids + 1)
    st = runner.stats()
    assert st["graph_replays"] == 1 and st["captured_graphs"] == [(1, 64), (2, 64)]
    assert len(st["capture_failures"]) == 2


def test_host_stage_equals_the_device_fill_path():
    """A host-built batch staged in two copies (capture.host_stage) leaves the static views
    exactly as building device tensors and padding them (StaticBuffers.fill) does, draft rows
    included, and a smaller batch after a larger one leaves nothing of it behind."""
    from capture.host_stage import HostBatch, HostStage
    from compiled_spec.engine.batch import host_batch_to_device

    drafts = torch.arange(100, 112)  # [3 requests x k=4] device-resident drafts, flattened
    big = HostBatch(input_ids=[5, 0, 0, 7, 0, 9, 0, 0, 0], positions=[4, 5, 6, 2, 3, 8, 9, 10, 11],
                    slots=[4, 5, 6, 18, 19, 40, 41, -1, -1], seq_lens=[7, 4, 12],
                    query_start_loc=[0, 3, 5, 9], tables=[[0], [1, 3], [2, 2, 6]],
                    max_query_len=4, max_seq_len=12, draft_dst=[1, 2, 4, 6, 7, 8],
                    draft_src=[0, 1, 4, 8, 9, 10])
    small = HostBatch(input_ids=[3, 0], positions=[9, 10], slots=[9, 10], seq_lens=[11],
                      query_start_loc=[0, 2], tables=[[4]], max_query_len=2, max_seq_len=11,
                      draft_dst=[1], draft_src=[5])
    bufs, ref_bufs = StaticBuffers(16, 4, 8, CPU), StaticBuffers(16, 4, 8, CPU)
    stage = HostStage(bufs)
    for hb, tokens, seqs in ((big, 12, 3), (small, 4, 2)):
        got = stage.fill(hb, tokens, seqs, 4, 64, drafts)
        ids, pos, meta = host_batch_to_device(hb, CPU, drafts)
        want = ref_bufs.fill(LiveBatch(ids, pos, meta), tokens, seqs, 4, 64)
        assert torch.equal(got.input_ids, want.input_ids)
        assert got.input_ids[hb.draft_dst].tolist() == [100 + s for s in hb.draft_src]
        assert torch.equal(got.positions, want.positions)
        for f in ("slot_mapping", "seq_lens", "query_start_loc", "block_tables"):
            assert torch.equal(getattr(got.meta, f), getattr(want.meta, f)), f
        assert (got.meta.max_query_len, got.meta.max_seq_len) == (4, 64)
        assert got.input_ids.data_ptr() == bufs.input_ids.data_ptr()  # the captured pointers
    with pytest.raises(ValueError, match="does not fit"):
        stage.fill(big, 20, 3, 4, 64, drafts)
    with pytest.raises(ValueError, match="no drafts"):
        stage.fill(small, 4, 2, 4, 64, None)


@pytest.mark.parametrize("width,first,cols", [(3, 1, 2), (4, 1, 4), (1, 0, 1)])
def test_host_stage_draft_grid_equals_the_index_lists(width, first, cols):
    """``HostBatch.draft_grid`` (one strided copy of 2-D drafts: a chain's [n, k], a tree's
    tokens [n, N] past the root, vanilla's [n, 1]) stages exactly what the batch's index lists
    stage from the same drafts flattened, after a batch that used the lists."""
    from capture.host_stage import HostBatch, HostStage

    n = 3
    drafts = torch.arange(100, 100 + (n + 1) * cols).view(n + 1, cols)  # a spare row: unread
    taken = width - first  # the last ``taken`` columns of each request's row
    dst = [i * width + first + j for i in range(n) for j in range(taken)]
    src = [i * cols + cols - taken + j for i in range(n) for j in range(taken)]
    t = n * width
    ids = [7 + i if i % width < first else 0 for i in range(t)]
    hb = HostBatch(input_ids=ids, positions=list(range(t)), slots=list(range(t)),
                   seq_lens=[(i + 1) * width for i in range(n)],
                   query_start_loc=list(range(0, t + 1, width)), tables=[[0, 1]] * n,
                   max_query_len=width, max_seq_len=t, draft_dst=dst, draft_src=src)
    bufs = StaticBuffers(16, 4, 8, CPU)
    stage = HostStage(bufs)
    want = stage.fill(hb, t, n, width, 64, drafts.reshape(-1)).input_ids.clone()
    stage.fill(dataclasses.replace(hb, input_ids=[1] * t), t, n, width, 64, drafts.reshape(-1))  # stale rows
    got = stage.fill(dataclasses.replace(hb, draft_grid=(width, first)), t, n, width, 64, drafts).input_ids
    assert torch.equal(got, want)
    assert got[dst].tolist() == drafts.reshape(-1)[src].tolist()


def test_host_stage_copies_no_extra_or_rows_already_in_place():
    """An extra its producer wrote into the buffers (an early tree graph's depths and masks)
    and rows already in a buffer (``put_rows``: a precombined fc) cost no copy launch; any
    other source is copied."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from capture.host_stage import HostBatch, HostStage, put_rows

    class Copies(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.copy_:
                Copies.n += 1
            return func(*args, **(kwargs or {}))

    bufs = StaticBuffers(8, 2, 4, CPU, token_extras={"depth": ((), torch.int64)})
    stage = HostStage(bufs)
    hb = HostBatch(input_ids=[1, 2, 3, 4], positions=[0, 1, 2, 3], slots=[0, 1, 2, 3],
                   seq_lens=[4], query_start_loc=[0, 4], tables=[[0]], max_query_len=4,
                   max_seq_len=4)
    own = bufs.extras["depth"][:4]
    own.copy_(torch.tensor([0, 1, 1, 2]))
    for extra, copies in ((own, 2), (torch.tensor([0, 1, 2, 2]), 3)):  # 2: the two uploads
        Copies.n = 0
        with Copies():
            got = stage.fill(hb, 4, 1, 4, 4, None, {"depth": extra})
        assert Copies.n == copies and torch.equal(got.extras["depth"], extra)
    buf, rows = torch.zeros(6, 3), torch.randn(4, 3)
    for src, copies in ((buf[:4], 0), (rows, 1)):
        Copies.n = 0
        with Copies():
            put_rows(buf, src)
        assert Copies.n == copies
    assert torch.equal(buf[:4], rows)


def test_host_stage_of_a_loop_with_extras_equals_the_device_fill_path():
    """An S-step loop batch (a draft-tree expansion: per-step positions, slots, seq_lens) with a
    per-token and a per-sequence extra stages as StaticBuffers.fill pads it; a smaller batch
    after a larger one leaves nothing of it behind (padding rows inert, extras zeroed)."""
    from capture.host_stage import HostBatch, HostStage
    from compiled_spec.engine.batch import metadata_to_device

    def spec(n_seq: int, base: int) -> tuple[HostBatch, LiveBatch]:
        k, steps = 2, 3  # K nodes per request, 3 expansion steps
        pos = [[base + r * 10 + j for r in range(n_seq) for _ in range(k)] for j in range(steps)]
        slots = [[p * 2 + i % 2 for i, p in enumerate(row)] for row in pos]
        lens = [[base + r * 10 + j + 4 for r in range(n_seq)] for j in range(steps)]
        qsl = [i * k for i in range(n_seq + 1)]
        tables = [[r, r + 1][: 1 + r % 2] for r in range(n_seq)]
        hb = HostBatch(input_ids=[0] * (n_seq * k), positions=pos, slots=slots, seq_lens=lens,
                       query_start_loc=qsl, tables=tables, max_query_len=k,
                       max_seq_len=max(map(max, lens)))
        p_t, meta = metadata_to_device(CPU, pos, slots, lens, qsl, tables, k, hb.max_seq_len)
        extras = {"mask": torch.arange(n_seq * k * 3).view(-1, 3) % 2 == 0,
                  "feed": torch.randn(n_seq, 5)}
        return hb, LiveBatch(torch.zeros(n_seq * k, dtype=torch.int64), p_t, meta, extras)

    kw = dict(num_steps=3, token_extras={"mask": ((3,), torch.bool)},
              seq_extras={"feed": ((5,), torch.float32)})
    bufs, ref_bufs = StaticBuffers(16, 8, 4, CPU, **kw), StaticBuffers(16, 8, 4, CPU, **kw)
    stage = HostStage(bufs)
    for n_seq, base, tokens, seqs in ((4, 7, 16, 8), (2, 30, 8, 4)):
        hb, live = spec(n_seq, base)
        got = stage.fill(hb, tokens, seqs, 2, 64, None, live.extras)
        want = ref_bufs.fill(live, tokens, seqs, 2, 64)
        assert torch.equal(got.positions, want.positions) and got.positions.shape == (3, tokens)
        for f in ("slot_mapping", "seq_lens", "query_start_loc", "block_tables"):
            assert torch.equal(getattr(got.meta, f), getattr(want.meta, f)), f
        for name in ("mask", "feed"):
            assert torch.equal(got.extras[name], want.extras[name]), name
    with pytest.raises(ValueError, match="extras"):
        stage.fill(hb, 8, 4, 2, 64, None, {"mask": live.extras["mask"]})
    with pytest.raises(ValueError, match="steps"):
        one = HostBatch(**{**hb.__dict__, "positions": hb.positions[0], "slots": hb.slots[0],
                           "seq_lens": hb.seq_lens[0]})
        stage.fill(one, 8, 4, 2, 64, None, live.extras)


@pytest.mark.parametrize("kind,n", [("decode", 3), ("decode", 6), ("verify", 3), ("mixed", 5)])
def test_run_host_replays_like_run_and_counts_misses(world, kind, n):
    """The engine's path (host lists staged in two copies) replays the same graph as ``run`` and
    gives its exact output; what no graph fits comes back as None with its reason counted."""
    from capture.host_stage import HostBatch

    model = world[0]
    q = 4 if kind != "decode" else 1
    runner = CpuReplayRunner(kind, model.forward, [s * q for s in (1, 2, 4)],
                             StaticBuffers(8 * q, 8, 16, CPU), query_len=q,
                             seq_len_buckets=(16, 64))
    runner.capture()
    live = _batch(world, kind, n)
    m = live.meta
    hb = HostBatch(input_ids=live.input_ids.tolist(), positions=live.positions.tolist(),
                   slots=m.slot_mapping.tolist(), seq_lens=m.seq_lens.tolist(),
                   query_start_loc=m.query_start_loc.tolist(), tables=m.block_tables.tolist(),
                   max_query_len=m.max_query_len, max_seq_len=m.max_seq_len)
    snap = [(k.clone(), v.clone()) for k, v in model.caches]
    ref = runner.run(live)
    ref = ref.clone() if ref is not None else None
    for (k, v), (ks, vs) in zip(model.caches, snap):
        k.copy_(ks), v.copy_(vs)
    out = runner.run_host(hb)
    st = runner.stats()
    if n <= 4:
        assert st["graph_replays"] == 2 and torch.equal(out, ref)
    else:  # above the largest size: run() fell back, run_host hands it back to the caller
        assert out is None and st["fallback_reasons"] == {"size": 2}
    wide = HostBatch(**{**hb.__dict__, "tables": [[0] * 17] * hb.num_seqs})
    assert runner.run_host(wide) is None and runner.fallback_reasons["block_table_width"] == 1
    if kind == "decode":
        long_q = HostBatch(**{**hb.__dict__, "max_query_len": 2})
        assert runner.run_host(long_q) is None and runner.fallback_reasons["query_len"] == 1


def test_fill_dummy_splits_tokens_among_sequences():
    """A varlen graph's dummy batch: the tokens as even as they go over the sequences (each
    one's positions from 0), every slot -1; a fixed-shape graph's as before."""
    bufs = StaticBuffers(16, 4, 8, CPU)
    d = bufs.fill_dummy(10, 4, 4, 64)
    assert d.meta.query_start_loc.tolist() == [0, 3, 6, 8, 10]
    assert d.meta.seq_lens.tolist() == [3, 3, 2, 2]
    assert d.positions.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1]
    assert (d.meta.slot_mapping == -1).all() and d.meta.max_query_len == 4
    d = bufs.fill_dummy(16, 4, 4, 64)
    assert d.meta.query_start_loc.tolist() == [0, 4, 8, 12, 16]
    assert d.positions.tolist() == [0, 1, 2, 3] * 4
    with pytest.raises(ValueError, match="tokens"):
        bufs.fill_dummy(17, 4, 4, 64)


@pytest.mark.parametrize("kind,n", [("mixed", 5), ("verify", 3), ("decode", 6)])
def test_varlen_graph_pads_tokens_and_sequences(world, kind, n):
    """A varlen graph (``seqs``): any split of its tokens among at most ``seqs`` sequences of at
    most query_len each replays the smallest token size that holds them, from host lists or a
    live batch, with the eager output and no KV written by padding; what it cannot hold
    (more sequences, a longer query, more tokens) runs eagerly, counted by reason."""
    from capture.host_stage import HostBatch

    model = world[0]
    runner = CpuReplayRunner("mixed", model.forward, [4, 8, 16], StaticBuffers(16, 6, 16, CPU),
                             query_len=4, seqs=6, seq_len_buckets=(64,))
    runner.capture()
    assert runner.captured_sizes == [4, 8, 16]
    live = _batch(world, kind, n)
    snap = [(k.clone(), v.clone()) for k, v in model.caches]
    ref = model.forward(live)
    ref_caches = [(k.clone(), v.clone()) for k, v in model.caches]
    for (k, v), (ks, vs) in zip(model.caches, snap):
        k.copy_(ks), v.copy_(vs)
    out = runner.run(live)
    size = pad_to(live.num_tokens, [4, 8, 16])
    st = runner.stats()
    assert st["graph_replays"] == 1 and st["padded_rows"] == size - live.num_tokens, st
    assert out.data_ptr() == runner._graphs[(size, 64)][1].data_ptr()  # a static view
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    _assert_caches(model, ref_caches, snap, live)
    m = live.meta
    hb = HostBatch(input_ids=live.input_ids.tolist(), positions=live.positions.tolist(),
                   slots=m.slot_mapping.tolist(), seq_lens=m.seq_lens.tolist(),
                   query_start_loc=m.query_start_loc.tolist(), tables=m.block_tables.tolist(),
                   max_query_len=m.max_query_len, max_seq_len=m.max_seq_len)
    for (k, v), (ks, vs) in zip(model.caches, snap):
        k.copy_(ks), v.copy_(vs)
    torch.testing.assert_close(runner.run_host(hb), ref, rtol=1e-5, atol=1e-5)
    for change, why in ((dict(max_query_len=5), "query_len"),
                        (dict(tables=hb.tables + [[0]] * (7 - n), seq_lens=hb.seq_lens +
                              [0] * (7 - n), query_start_loc=hb.query_start_loc +
                              [hb.num_tokens] * (7 - n)), "seqs"),  # 7 q_len-0 sequences
                        (dict(input_ids=[0] * 17, positions=[0] * 17, slots=[-1] * 17), "size")):
        assert runner.run_host(HostBatch(**{**hb.__dict__, **change})) is None
        assert runner.fallback_reasons.get(why) == 1, (why, runner.fallback_reasons)


def test_emulated_replay_poisons_the_other_graphs_outputs_of_its_pool():
    """A real graph's outputs are valid until the next replay of any graph of its pool; the
    CPU emulation makes reading them later fail loudly (NaN / huge negative ints), so engine
    code that keeps graph outputs across replays without copying is caught by CPU tests."""
    from capture.emulate import emulate_graph

    x = torch.arange(4.0)
    pool, other_pool = object(), object()
    ga, out_a = emulate_graph(lambda: (x * 2, x.long()), pool)
    gb, out_b = emulate_graph(lambda: x + 1, pool)
    gc, out_c = emulate_graph(lambda: x - 1, other_pool)
    ga.replay()
    assert torch.equal(out_a[0], x * 2) and torch.equal(out_a[1], x.long())
    gb.replay()  # same pool: a's outputs are stale now
    assert torch.isnan(out_a[0]).all() and (out_a[1] < -(1 << 29)).all()
    assert torch.equal(out_b, x + 1)
    gc.replay()  # another pool: b's outputs stay valid
    assert torch.equal(out_b, x + 1) and torch.equal(out_c, x - 1)
    ga.replay()
    assert torch.equal(out_a[0], x * 2)


def test_step_captures_name_a_table_or_sequence_they_cannot_hold():
    """The propose and first-pass graphs (StepCapture._rows) share one check of a batch's block
    tables and seq_lens against what they captured: the reason names which was too large."""
    from compiled_spec.engine.batch import Span
    from compiled_spec.engine.propose_graph import ProposeGraphs
    from compiled_spec.kv_cache import BlockAllocator
    from compiled_spec.spec.propose_batch import ProposeBatch

    alloc = BlockAllocator(16, 4)
    alloc.grow(0, 8)   # 2 blocks
    alloc.grow(1, 13)  # 4 blocks
    g = object.__new__(ProposeGraphs)
    g.allocator, g.max_blocks, g.bucket = alloc, 4, 16

    def batch(*spans: Span) -> ProposeBatch:
        return ProposeBatch(first_pass=list(spans), token_ids=[], hidden_rows=[], step_limits=[],
                            temperature=[], seeds=[])

    tables, (pos, slots, lens, qsl) = g._rows(batch(Span(0, 5, 3), Span(1, 12, 1)))
    assert tables == [alloc.tables[0], alloc.tables[1]] and lens == [8, 13] and qsl == [0, 3, 4]
    assert pos == [5, 6, 7, 12] and slots[-1] == alloc.tables[1][3] * 4
    g.bucket = 12
    assert g._rows(batch(Span(0, 5, 3), Span(1, 12, 1))) == "max_seq_len"
    g.bucket, g.max_blocks = 16, 3
    assert g._rows(batch(Span(0, 5, 3), Span(1, 12, 1))) == "block_table_width"
    assert g._rows(batch(Span(0, 5, 3)))[1][2] == [8]  # a batch within both is taken
