"""The paged-attention launch policy (kernels/launch.py) and the start-up warm-up that compiles
every configuration it can pick. A configuration the enumeration missed would JIT-compile inside
a request (a few hundred ms on the H200, once per new prompt-length class before this existed)."""
from __future__ import annotations

import random

import pytest

from kernels.launch import BLOCK_N, attention_launch, reachable_configs

# (num_heads, num_kv_heads): SmolLM2 (GQA 3), Llama-3.1-8B (GQA 4), MHA, a wide group (GQA 8)
SHAPES = [(9, 3), (32, 8), (4, 4), (16, 2)]


@pytest.mark.parametrize("heads,kv", SHAPES)
@pytest.mark.parametrize("sms", [132, 16, None])
def test_every_launch_is_enumerated_and_every_enumerated_one_is_reachable(heads, kv, sms):
    max_len = 2048
    allowed = set(reachable_configs(heads // kv, kv, max_len, max_len, sms))
    rng = random.Random(0)
    met = set()
    calls = [(b, q, s) for b in (1, 2, 3, 5, 16, 64) for q in (1, 2, 3, 4, 6, 8, 9, 16, 17, 33,
                                                                 64, 65, 200, 2000)
             for s in (q, q + 1, q + 63, q + 130, q + 260, q + 520, q + 900, max_len)
             if s <= max_len]
    calls += [(rng.randint(1, 64), q, rng.randint(q, max_len))
              for q in (rng.randint(1, max_len) for _ in range(3000))]
    for b, q, s in calls:
        cfg = attention_launch(heads // kv, kv, b, q, s, sms)
        assert cfg.key in allowed, (b, q, s, cfg)
        assert cfg.kv_chunk % BLOCK_N == 0 and cfg.kv_chunk * cfg.num_splits >= s
        assert cfg.q_blocks * cfg.block_q >= q
        met.add(cfg.key)
    assert met == allowed, sorted(allowed - met)  # nothing warmed in vain


def test_launch_policy_values():
    # SmolLM2 (group 3 -> 4 rows per token): decode uses 4 tokens per program (16 rows, the
    # minimum tl.dot tile), prefill 16; no KV split off the GPU or when the grid is full.
    assert attention_launch(3, 3, 1, 1, 512, None).key == (4, 1)
    assert attention_launch(3, 3, 1, 300, 300, None).key == (16, 1)
    # Batch-1 decode at 512 keys on 132 SMs: 3 programs -> split to one 64-key block each.
    assert attention_launch(3, 3, 1, 1, 512, 132).key == (4, 8)
    assert attention_launch(3, 3, 64, 1, 512, 132).key == (4, 1)  # 192 programs fill the GPU
    assert attention_launch(3, 3, 1, 1, 64, 132).key == (4, 1)  # one key block: no split
    assert reachable_configs(3, 3, 2048, 2048, None) == [(4, 1), (8, 1), (16, 1)]
    assert reachable_configs(3, 3, 1, 2048, 132) == [(4, s) for s in (1, 2, 4, 8, 16, 32)]


def test_merge_chunk_policy():
    """The fused merge's splits per unrolled step: as many [rows, dim] fp32 tiles as fit 8192
    elements, never more than the splits, never 0, and a power of two that divides them."""
    from kernels.launch import merge_chunk_for

    assert merge_chunk_for(16, 64, 32) == 8  # SmolLM2 batch-1 decode at 2048 keys: 4 steps
    assert merge_chunk_for(64, 64, 8) == 2  # an 8/32 tree's q block
    assert merge_chunk_for(16, 64, 4) == 4  # fewer splits than the budget allows
    assert merge_chunk_for(64, 256, 8) == 1  # a tile past the budget: one split per step
    for rows in (16, 32, 64, 128):
        for dim in (16, 32, 64, 128, 256):
            for splits in (2, 4, 8, 16, 32, 64):
                c = merge_chunk_for(rows, dim, splits)
                assert 1 <= c <= splits and splits % c == 0 and c & (c - 1) == 0
                assert c == 1 or c * rows * dim <= 8192


# Index metadata the engine passes as views into packed buffers, at any int32 offset.
METADATA_PTRS = {"block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "tree_start_ptr",
                 "tree_mask_ptr", "slot_ptr"}
_SPECIALIZATIONS = """
import json, torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl
from kernels.attention_merge_triton import _merge_splits_kernel
from kernels.attention_triton import _paged_attn_kernel
from kernels.rope_kv_triton import _rope_write_kv_kernel
from kernels.write_kv_triton import _write_kv_kernel
from kernels.qkv_rope_triton import _qkv_rope_kv_kernel
buf = torch.zeros(64, dtype=torch.int32)
out = {}
for k in (_paged_attn_kernel, _merge_splits_kernel, _rope_write_kv_kernel, _write_kv_kernel,
          _qkv_rope_kv_kernel):
    for p in k.params:
        if p.name.endswith("_ptr"):  # Triton's key for a fresh tensor and for a view 4 bytes in
            keys = {native_specialize_impl(BaseBackend, t, False, not p.do_not_specialize,
                                           not p.do_not_specialize_on_alignment)
                    for t in (buf, buf[1:])}
            out[k.fn.__name__ + "." + p.name] = len(keys)
print(json.dumps(out))
"""


def test_metadata_pointers_share_one_binary_whatever_their_offset():
    """The warm-up launches on fresh metadata tensors (16-byte aligned); the engine passes views
    at any offset. Were those pointers specialised on alignment, every warmed binary would be
    compiled again at the engine's first launch (the twenty-eighth session's cold starts on the
    H200: ~4 s of SmolLM2's, ~7 s of the 8B shape's). Triton's own specialisation function, run
    on each kernel's parameters as declared (compiled kernels: no interpreter)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _SPECIALIZATIONS], env=env, cwd=root,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    keys = json.loads(run.stdout.strip().splitlines()[-1])
    meta = {n: c for n, c in keys.items() if n.split(".")[1] in METADATA_PTRS}
    assert len(meta) == 9, sorted(keys)  # 5 in attention, 1 in the merge, a slot map in three
    assert all(c == 1 for c in meta.values()), meta
    # The probe does tell the two apart where alignment is specialised (vectorised data).
    assert keys["_paged_attn_kernel.q_ptr"] == 2
