"""Compile, at start-up, every paged-attention binary an engine can launch (``kernels.launch``)
and its rope + KV-write kernel.

CUDA-graph capture compiles what decode and verification use; an uncaptured prefill meets new
(block_q, num_splits) classes as prompts vary, and each new one used to JIT-compile inside the
request that met it. Here each reachable configuration is launched once on a batch whose only
sequence has no query tokens: the kernel (with its fused split merge) is compiled for the
engine's real cache tensors, dtypes and strides, returns at once, and writes nothing the engine
reads.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

import kernels.warmup_parallel as parallel
from kernels import warmup_pending
from kernels.dispatch import PDL_MAX_ROWS, pdl_scope
from kernels.launch import BLOCK_N, reachable_configs


def warm_attention(k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
                   v_cache: torch.Tensor,
                   num_heads: int, max_query_len: int, max_seq_len: int,
                   force: bool = False, sms: int | None = None,
                   configs: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """Launch every reachable configuration once (or ``configs``: (block_q, num_splits)
    pairs); returns them. Off CUDA nothing runs (the engine uses the reference ops there)
    unless ``force`` (tests, under TRITON_INTERPRET=1, with ``sms`` standing in for the GPU's
    multiprocessor count)."""
    if not (k_cache.is_cuda or force):
        return []
    from kernels.attention_triton import _paged_attention, num_sms

    _, _, num_kv_heads, head_dim = k_cache.shape
    dev, dtype = k_cache.device, k_cache.dtype
    if configs is None:
        configs = reachable_configs(num_heads // num_kv_heads, num_kv_heads, max_query_len,
                                    max_seq_len, num_sms(k_cache) if sms is None else sms)
    # q laid out as the decoder passes it: rope_write_kv's (or apply_rope's) contiguous output.
    query = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=dev)  # [1, heads, head_dim]
    tables = torch.zeros(1, 2, dtype=torch.int32, device=dev)
    seq_lens = torch.zeros(1, dtype=torch.int32, device=dev)
    qsl = torch.zeros(2, dtype=torch.int32, device=dev)  # one sequence, zero query tokens
    for block_q, splits in configs:
        _paged_attention(query, k_cache, v_cache, tables, seq_lens, qsl, block_q,
                         splits * BLOCK_N, 1.0, num_splits=splits)
    return configs


def warm_rope_write_kv(k_cache: torch.Tensor,  # [num_blocks, page_size, num_kv_heads, head_dim]
                       v_cache: torch.Tensor, num_heads: int) -> None:
    """Compile the rope + KV-write kernel for this cache (one token, slot -1: nothing written),
    laid out as the decoder passes it: q/k and v as views of one fused qkv row; and the rope
    table gather that feeds it (fp32 tables of a multiple of 16 rows, as models have)."""
    from kernels.rope_kv_triton import rope_table_triton, rope_write_kv_triton

    _, _, kvh, d = k_cache.shape
    # [1, heads + 2 kv, d]: the decoder's qkv view (models/decoder.py, _write_qkv)
    qkv = torch.zeros(1, num_heads + 2 * kvh, d, dtype=k_cache.dtype, device=k_cache.device)
    qk, v = qkv[:, :num_heads + kvh], qkv[:, num_heads + kvh:]
    cs = torch.zeros(1, d, dtype=k_cache.dtype, device=k_cache.device)
    slots = torch.full((1,), -1, dtype=torch.int64, device=k_cache.device)
    rope_write_kv_triton(qk, v, k_cache, v_cache, slots, cs, cs, num_heads)
    table = torch.zeros(16, d, dtype=torch.float32, device=k_cache.device)
    rope_table_triton(torch.zeros(1, dtype=torch.int64, device=k_cache.device), table, table,
                      k_cache.dtype)


def warm_model_attention(layers: list[torch.nn.Module], max_query_len: int, max_seq_len: int,
                         defer: bool = False, gdc: bool = False) -> dict[str, float | int]:
    """``warm_attention`` once per distinct attention shape among ``layers`` (modules with
    ``num_heads`` and bound ``k_cache`` / ``v_cache``). Returns {configs, seconds}, plus the
    parallel_* counts of ``_compile_in_workers`` where workers compiled. ``defer``: workers
    that started are not waited for here; the first attention launch (or
    ``kernels.warmup_pending.finish``) joins them and loads the binaries, and adds "join_s"
    (its seconds) and the workers' counts to the returned dict then.

    ``gdc``: the binaries of launches with PDL (``kernels.dispatch.pdl_launch``: GDC=1, a
    binary of its own), which only calls of at most ``PDL_MAX_ROWS`` query tokens take, for an
    engine whose calls launch with PDL; without it the captures compiled them, one by one.
    Never deferred (the join must launch inside the PDL scope); no rope kernel (no GDC)."""
    if gdc:
        with pdl_scope(True):
            return _warm_model_attention(layers, min(max_query_len, PDL_MAX_ROWS), max_seq_len,
                                         False, True)
    return _warm_model_attention(layers, max_query_len, max_seq_len, defer, False)


def _warm_model_attention(layers: list[torch.nn.Module], max_query_len: int, max_seq_len: int,
                          defer: bool, gdc: bool) -> dict[str, float | int]:
    warmup_pending.finish()  # an earlier engine's, never launched
    t0 = time.perf_counter()
    seen: set[tuple] = set()
    out: dict[str, float | int] = {}
    procs: list = []  # workers not waited for yet
    serial: list[tuple[torch.Tensor, torch.Tensor, int, list[tuple[int, int]] | None]] = []

    def wait_workers() -> None:
        if not procs:
            return
        t1 = time.perf_counter()
        launched, failed = parallel.wait(procs)
        procs.clear()
        out["parallel_configs"] = out.get("parallel_configs", 0) + launched
        out["parallel_failed"] = out.get("parallel_failed", 0) + failed
        out["parallel_s"] = round(out.get("parallel_s", 0) + time.perf_counter() - t1, 3)

    for attn in layers:
        k, v = attn.k_cache, attn.v_cache
        key = (attn.num_heads, tuple(k.shape[1:]), k.dtype, k.stride(), k.device)
        if key in seen:
            continue
        seen.add(key)
        configs = None
        if _spreads(k):
            kvh = k.shape[2]
            configs = reachable_configs(attn.num_heads // kvh, kvh, max_query_len, max_seq_len,
                                        _sms(k))
            if procs:  # another shape's workers first: this one's may share their binaries
                wait_workers()
            started = _compile_in_workers(k, v, attn.num_heads, configs, gdc)
            if started:
                procs += started
                out["parallel_workers"] = out.get("parallel_workers", 0) + len(started)
        serial.append((k, v, attn.num_heads, configs))
    deferred = defer and bool(procs)

    def join() -> None:
        t1 = time.perf_counter()
        wait_workers()
        count = 0
        for k, v, heads, configs in serial:  # from the cache the workers filled, or compiled
            count += len(warm_attention(k, v, heads, max_query_len, max_seq_len,
                                        configs=configs))
            if k.is_cuda and not gdc:  # the rope + KV-write kernel too: one padding row (slot -1)
                warm_rope_write_kv(k, v, heads)
                count += 1
        if count and torch.cuda.is_available():
            torch.cuda.synchronize()
        out["configs"] = count
        out["join_s" if deferred else "serial_s"] = round(time.perf_counter() - t1, 3)

    if deferred:
        warmup_pending.PENDING.append(join)
        out["configs"] = 0  # set by the join
    else:
        join()
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def _spreads(k_cache: torch.Tensor) -> bool:
    """Whether this cache's warm-up may use worker processes (CUDA, not switched off)."""
    return k_cache.is_cuda and parallel.enabled()


def _sms(k_cache: torch.Tensor) -> int | None:
    from kernels.attention_triton import num_sms

    return num_sms(k_cache)


def _compile_in_workers(k: torch.Tensor, v: torch.Tensor, num_heads: int,
                        configs: list[tuple[int, int]], gdc: bool = False) -> list:
    """When the second of ``configs`` takes a compile (Triton's cache is cold), the others are
    compiled by worker processes (``kernels.warmup_parallel``), left running; the serial
    warm-up after them loads their binaries from the cache. Returns the workers ([] when the
    cache is warm or nothing is left to share)."""
    rest = configs[2:]
    # The workers start before the two launches that tell a cold cache from a warm one: a
    # worker's own start (interpreter, torch, CUDA context) is most of its time, and waiting
    # for the verdict first put ~2.9 s of in-process compiles ahead of it on a cold H200 (the
    # 8B shape, twenty-eighth session). A warm verdict stops them unfinished.
    procs = parallel.start(
        [parallel.spec_of(k, num_heads, g, rope=i == 0 and not gdc, gdc=gdc)
         for i, g in enumerate(parallel.shares(rest, parallel.num_workers(len(rest))))]
    ) if parallel.enough_to_share(len(rest)) else []
    # The process's first Triton launch pays one-time costs (driver, launcher stubs: ~0.2 s on
    # the H200 even from a warm cache, which sent warm starts to 8 workers for 4 s), so the
    # first configuration absorbs them and the second one's time says compile or load.
    try:
        warm_attention(k, v, num_heads, 1, 1, configs=configs[:1])
        torch.cuda.synchronize(k.device)
        t0 = time.perf_counter()
        warm_attention(k, v, num_heads, 1, 1, configs=configs[1:2])
        torch.cuda.synchronize(k.device)
    except BaseException:
        parallel.stop(procs)
        raise
    if not parallel.worth_spreading(time.perf_counter() - t0, len(rest)):
        parallel.stop(procs)  # warm cache: the serial warm-up loads the rest at once
        return []
    return procs


def _worker(spec: dict[str, Any]) -> None:
    """A cold start's compile worker (``kernels.warmup_parallel.start``): launches its share of
    the configurations on two cache blocks of the engine's dtype, shape and strides, the same
    specialisation key (divisibility, == 1) as the engine's caches, so the binaries it compiles
    are the ones the engine looks up. Under TRITON_INTERPRET=1 (CPU tests) they run interpreted."""
    force = os.environ.get("TRITON_INTERPRET") == "1"
    dev = torch.device("cpu") if force else torch.device("cuda", spec["device"])
    dtype = getattr(torch, spec["dtype"])
    size, stride = [2, *spec["shape"]], spec["stride"]
    k = torch.empty_strided(size, stride, dtype=dtype, device=dev)
    v = torch.empty_strided(size, stride, dtype=dtype, device=dev)
    configs = [tuple(c) for c in spec["configs"]]
    with pdl_scope(bool(spec.get("gdc"))):  # GDC=1 binaries (launched with PDL) if asked
        done = warm_attention(k, v, spec["num_heads"], 1, 1, force=force, configs=configs)
    if spec["rope"] and not force:
        warm_rope_write_kv(k, v, spec["num_heads"])
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    print(f"launched {len(done)}", flush=True)


if __name__ == "__main__":
    _worker(json.loads(sys.argv[1]))
