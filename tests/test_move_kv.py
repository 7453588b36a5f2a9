"""The one-launch KV slot mover of draft trees (``kernels.move_kv_triton``) against the per-layer
gathers and scatters it replaces (``spec.tree.compact_kv``), under the Triton CPU interpreter in
a subprocess (the interpreter must be chosen before triton is imported)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from compiled_spec.spec.tree import KVCompactor, compact_kv
from tests.triton_interpret import run_interpreted


def _caches(layers: int, dtype: torch.dtype, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn(6, 4, 3, 8, generator=g).to(dtype) for _ in range(2))
            for _ in range(layers)]


# Moves as a tree step makes them: accepted nodes 2 and 3 of one request land on slots 1 and 2
# (slot 2 is read by the first move and written by the second), another request's node 5 lands
# on slot 9 (10 + 1 - 2 = its first position after the root). Then a batch of many moves.
MOVES = {"overlapping": ([2, 3, 13], [1, 2, 9]),
         "many": (list(range(12, 24)), list(range(0, 12)))}


def _worker() -> None:
    from kernels.move_kv_triton import cache_table, move_slots_triton

    out = {}
    for name, (src, dst) in MOVES.items():
        for dtype in (torch.float32, torch.bfloat16):
            ref, got = _caches(3, dtype, 0), _caches(3, dtype, 0)
            compact_kv(ref, src, dst)
            flat = [c for kv in got for c in kv]
            move_slots_triton(cache_table(flat), flat[0], torch.tensor([src, dst]))
            out[f"{name}_{dtype}"] = all(torch.equal(a, b) for a, b in zip(
                [c for kv in ref for c in kv], flat))
    # The compactor's kernel path, its address table reused across calls.
    comp, ref, got = KVCompactor(use_kernel=True), _caches(2, torch.float32, 1), \
        _caches(2, torch.float32, 1)
    for src, dst in MOVES.values():
        compact_kv(ref, src, dst)
        comp(got, src, dst)
    out["compactor"] = all(torch.equal(a, b) for x, y in zip(ref, got) for a, b in zip(x, y))
    print("RESULTS " + json.dumps(out))


def test_move_kv_kernel_equals_per_layer_moves() -> None:
    res = run_interpreted(__file__)
    assert res == {k: True for k in res} and len(res) == 5, res


def test_overlapping_moves_read_sources_first() -> None:
    """The reference itself: slot 2 is moved to 1 before slot 3 overwrites it."""
    caches = _caches(1, torch.float32, 2)
    before = caches[0][0].view(-1, 3, 8).clone()
    compact_kv(caches, *MOVES["overlapping"])
    after = caches[0][0].view(-1, 3, 8)
    assert torch.equal(after[1], before[2]) and torch.equal(after[2], before[3])
    assert torch.equal(after[9], before[13])


def test_compactor_off_gpu_uses_the_reference_and_checks_caches() -> None:
    comp, ref, got = KVCompactor(), _caches(2, torch.float32, 3), _caches(2, torch.float32, 3)
    compact_kv(ref, [5], [1])
    comp(got, [5], [1])
    assert comp._table is None  # no kernel on the CPU
    assert all(torch.equal(a, b) for x, y in zip(ref, got) for a, b in zip(x, y))
    from kernels.move_kv_triton import cache_table

    with pytest.raises(ValueError, match="KV caches differ"):
        cache_table([torch.zeros(2, 3), torch.zeros(2, 4)])


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker()


def test_a_wrong_kernel_is_caught_before_the_first_move(monkeypatch):
    """The compactor checks the kernel against the per-layer moves before its first real use:
    a kernel that moved nothing would corrupt the target's KV silently otherwise."""
    import kernels.move_kv_triton as mk

    monkeypatch.setattr(mk, "move_slots_triton", lambda table, like, idx: None)
    caches = _caches(2, torch.float32, 4)
    before = [c.clone() for kv in caches for c in kv]
    with pytest.raises(RuntimeError, match="KV move kernel disagrees"):
        KVCompactor(use_kernel=True)(caches, [5], [1])
    assert all(torch.equal(a, b) for a, b in zip(before, [c for kv in caches for c in kv]))


def test_move_counts_fall_in_few_kernel_variants_all_compiled_at_start(monkeypatch):
    """Each move-count class is one compiled variant of the kernel; the compactor's first use
    (start-up: the early tree graph's warm-up) runs every class a step can meet, so no serving
    step compiles one (a power of two per variant cost 55-170 ms each on the H200)."""
    import kernels.move_kv_triton as mk
    from compiled_spec.spec.tree import warm_move_tiles

    assert [mk.move_tile(n) for n in (1, 16, 17, 64, 80, 256, 257, 1025)] == [
        16, 16, 64, 64, 256, 256, 1024, 2048]
    seen: list[tuple[int, tuple[int, ...]]] = []
    monkeypatch.setattr(mk, "move_slots_triton",
                        lambda table, like, idx: seen.append((mk.move_tile(idx.shape[1]),
                                                              tuple(like.shape))))
    like = torch.zeros(6, 4, 3, 8)  # [blocks, page, H, D]
    warm_move_tiles(like)
    assert [t for t, _ in seen] == [16, 64, 256]
    assert all(shape[0] * shape[1] >= 256 and shape[1:] == (4, 3, 8) for _, shape in seen)
