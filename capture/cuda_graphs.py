"""CUDA-graph capture by dummy runs at start-up, and padded replay.

``GraphRunner`` owns one component (target decode, target verify, draft loop, ...): a callable
``fn(LiveBatch) -> tensors`` (typically a torch.compile'd forward; compile it without its own
cudagraphs, i.e. not mode="reduce-overhead"), the token sizes to capture and the StaticBuffers the
graphs read. ``capture()`` warms each size up on a side stream (compilation and Triton autotuning
must happen outside capture), then captures it into one shared memory pool, largest size first so
the smaller graphs reuse the pool's blocks (as vLLM does). ``run(live)`` pads ``live`` into the
static buffers, replays the graph of the smallest captured size that fits and returns views of
the outputs sliced to the live rows. Anything that cannot replay runs ``fn`` directly (compiled,
no graph) and is counted: a step that silently misses its graph is the bug class of vLLM's EAGLE-3
draft that was never captured (seeds/003), so ``GraphRegistry.assert_captured`` checks at
start-up that every named component has at least one graph (``capture.registry``).

Outputs are static graph memory: valid until the next replay of ANY graph of the same pool
(a later-captured graph may reuse a freed block of an earlier one as scratch). Consume or copy
them first, or pass ``clone_outputs=True``.

Capturing the whole k-step draft loop as one graph
--------------------------------------------------
Give the runner StaticBuffers(num_steps=k-1) and ``query_len=1``; ``fn`` is a plain Python loop::

    def draft_loop(b: LiveBatch) -> torch.Tensor:          # -> [B, k-1] draft ids
        tok, feed = b.input_ids, b.extras["feed"]          # [B], [B, h]
        out = []
        for j in range(b.num_steps):                        # fixed trip count: unrolled in capture
            positions, meta = b.step(j)                     # views of precomputed step j rows
            feed, h = draft(tok, feed, positions, {n: meta for n in layer_names})
            tok = pick(draft.compute_logits(h), ...)        # argmax / on-device sampling only
            out.append(tok)
        return torch.stack(out, 1)

Before replay the host builds every step's metadata at once, from engine state it already has
(proposer: ``Span(req, start + j, 1, write_limit)`` per step): positions +1 per step, seq_lens +1
per step, and the slot of the next lookahead position (-1 past the request's write limit), then
``stack_steps`` makes them [S, B] tensors that ``fill`` copies into the static buffers. Nothing in
the loop reads the device back or touches the host, so the captured launches are the whole loop.
Block tables must already cover all k lookahead positions (the proposer grows them first).
"""
from __future__ import annotations

import bisect
import logging
import os
import warnings
from typing import Any, Callable, Literal

import torch
from tqdm.auto import tqdm

from capture.errors import CaptureError, capture_retrying, describe_error
from capture.host_stage import HostBatch, HostStage
from capture.pad import LiveBatch, StaticBuffers
from capture.policy import bucket_max_seq_len, padding_table

log = logging.getLogger(__name__)

GraphFn = Callable[[LiveBatch], Any]  # outputs: a pytree of tensors, [T, ...] or [B, ...]


def _map_tensors(fn: Callable[[torch.Tensor], Any], x: Any) -> Any:
    """``fn`` over the tensors of a graph's outputs (a tensor, or tuples / lists / dicts of
    them, nested); anything else as it is. torch's pytree ``tree_map`` did the same at ~50 us
    of host time per replay (traced on the CPU), on the host-bound path of every step."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_map_tensors(fn, v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_map_tensors(fn, v) for v in x)
    if isinstance(x, dict):
        return {k: _map_tensors(fn, v) for k, v in x.items()}
    return x


def progress_enabled() -> bool:
    """Start-up progress bars (capture: which component, how many graphs of how many) go to
    stderr unless ``COMPILED_SPEC_PROGRESS=0``."""
    return os.environ.get("COMPILED_SPEC_PROGRESS", "1") != "0"


def capture_each(name: str, sizes: list[int], bucket: int, capture_one: Callable[[int], None],
                 failures: list[dict[str, Any]], strict: bool) -> None:
    """``capture_one(b)`` for every batch size, largest first (smaller graphs reuse the pool),
    with progress; a failure is recorded in ``failures`` and warned (raised when ``strict``),
    never silent. For runners that capture whole steps of their own (the propose graphs)."""
    for b in tqdm(sorted(sizes, reverse=True), desc=f"capture {name}", unit="graph",
                  disable=not progress_enabled()):
        try:
            capture_retrying(lambda: capture_one(b), strict, name,
                             {"size": b, "max_seq_len": bucket}, failures)
        except Exception as e:
            why = describe_error(e)
            failures.append({"size": b, "max_seq_len": bucket, "error": why})
            if strict:
                raise
            warnings.warn(f"{name}: CUDA graph capture failed for batch {b}: {why}",
                          RuntimeWarning, stacklevel=3)


def capture_graph(run: Callable[[], Any], pool: Any = None, warmup_iters: int = 2
                  ) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``run`` up on a side stream (compilation, autotuning and lazy initialisation must
    happen outside capture), then capture one call of it into ``pool``. Returns (graph, the
    captured call's outputs): static memory that every replay rewrites."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_iters):
            run()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool):
            out = run()
    except Exception:
        _stop_routing_to_pool(graph)
        raise
    return graph, out


def _stop_routing_to_pool(graph: torch.cuda.CUDAGraph) -> None:
    """After a capture raised: torch's capture_end throws before it tells the caching allocator
    to stop routing allocations into the graph's pool, and every later capture into that pool
    then fails at its start ("beginAllocateToPool: already recording to mempool_id", H200,
    twenty-ninth session: one failed prompt-size capture took the draft's graphs with it).
    Best effort: torch's private call, absent or refusing on some versions."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None:
        return
    try:
        end(torch.cuda.current_device(), graph.pool())
    except Exception:  # already stopped, or no pool: nothing left to undo
        pass


class GraphRunner:
    def __init__(self, name: str, fn: GraphFn, sizes: list[int], buffers: StaticBuffers, *,
                 seq_len_buckets: tuple[int, ...], query_len: int = 1, pool: Any = None,
                 output_rows: Literal["tokens", "seqs"] = "tokens", clone_outputs: bool = False,
                 strict: bool = False, warmup_iters: int = 2, seqs: int | None = None) -> None:
        """``sizes`` are token counts, each a multiple of ``query_len`` (the host max_query_len
        baked into the graph; the graph holds size // query_len sequences). ``seqs``: a
        varlen graph instead, every size any number of tokens split among at most ``seqs``
        sequences of at most ``query_len`` each (prompt steps of several sequences: a step
        pads its tokens to the smallest size that holds them, its sequences to ``seqs``).
        ``output_rows`` says whether outputs are per-token or per-sequence (how they are
        sliced)."""
        if query_len < 1 or any(s < 1 or (seqs is None and s % query_len) for s in sizes):
            raise ValueError(f"{name}: sizes {sizes} must be positive multiples of "
                             f"query_len={query_len}")
        if seqs is not None and (seqs < 1 or output_rows != "tokens"):
            raise ValueError(f"{name}: a varlen graph needs seqs >= 1 (got {seqs}) and "
                             f"per-token outputs")
        top = max(sizes, default=0)
        top_seqs = top // query_len if seqs is None else seqs
        if top > buffers.max_tokens or top_seqs > buffers.max_seqs:
            raise ValueError(f"{name}: largest size {top} ({top_seqs} sequences) does not fit "
                             f"the static buffers (tokens {buffers.max_tokens}, seqs "
                             f"{buffers.max_seqs})")
        self.name, self.fn, self.buffers, self.query_len = name, fn, buffers, query_len
        self.seqs = seqs
        self.sizes = sorted(set(sizes))
        self.seq_len_buckets = tuple(sorted(set(seq_len_buckets)))
        self.pool, self.output_rows, self.clone_outputs = pool, output_rows, clone_outputs
        self.strict, self.warmup_iters = strict, warmup_iters
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, Any]] = {}
        # bucket -> padded num_seqs by live num_seqs; varlen: the captured token sizes, sorted
        self._tables: dict[int, list[int]] = {}
        self.capture_failures: list[dict[str, Any]] = []
        self.graph_replays = self.padded_rows = self.eager_fallbacks = 0
        self.fallback_reasons: dict[str, int] = {}
        self._stage: HostStage | None = None  # numpy mirrors of the buffers, made on first use

    @property
    def enabled(self) -> bool:
        """Graphs exist only on CUDA; on the CPU every run is an (expected) eager fallback."""
        return self.buffers.device.type == "cuda"

    @property
    def captured_sizes(self) -> list[int]:
        return sorted({size for size, _ in self._graphs})

    # ---- start-up -------------------------------------------------------------------------
    @torch.inference_mode()  # as the engine runs: compiled code guards on inference mode
    def capture(self) -> None:
        if not self.enabled:
            log.info("%s: device %s, CUDA graphs disabled (runs eagerly)", self.name,
                     self.buffers.device)
            return
        if self._graphs or self.capture_failures:
            raise RuntimeError(f"{self.name}: capture() called twice")
        todo = [(size, bucket) for bucket in reversed(self.seq_len_buckets)
                for size in reversed(self.sizes)]  # largest first: smaller graphs reuse the pool
        # Progress (what, how many of how many): the first sizes also compile, which is what
        # makes a cold start-up take minutes.
        for size, bucket in tqdm(todo, desc=f"capture {self.name}", unit="graph",
                                 disable=not progress_enabled()):
            try:
                capture_retrying(lambda: self._capture_one(size, bucket), self.strict,
                                 self.name, {"size": size, "max_seq_len": bucket},
                                 self.capture_failures)
            except Exception as e:  # recorded and reported, never swallowed silently
                try:
                    torch.cuda.synchronize()
                except Exception:  # a sticky CUDA error: the message below still reports
                    pass
                why = describe_error(e)
                self.capture_failures.append({"size": size, "max_seq_len": bucket, "error": why})
                msg = f"{self.name}: CUDA graph capture failed for size {size}, " \
                      f"max_seq_len {bucket}: {why}"
                if self.strict:
                    raise CaptureError(msg) from e
                log.warning(msg)
                warnings.warn(msg, RuntimeWarning, stacklevel=2)
        for bucket in self.seq_len_buckets:
            sizes = sorted(s for s, b in self._graphs if b == bucket)
            if sizes:
                self._tables[bucket] = sizes if self.seqs is not None else padding_table(
                    [s // self.query_len for s in sizes])
        if self._graphs:
            self._stage = HostStage(self.buffers)  # pinned buffers now, not in the first step

    def _capture_one(self, size: int, bucket: int) -> None:
        # The dummy batch lives in the same static views that replay refills: the pointers the
        # graph bakes in are exactly the ones fill() writes.
        static = self.buffers.fill_dummy(size, self._padded_seqs(size), self.query_len, bucket)
        self._graphs[(size, bucket)] = self._make_graph(lambda: self.fn(static))

    def _make_graph(self, run: Callable[[], Any]) -> tuple[Any, Any]:
        return capture_graph(run, self.pool, self.warmup_iters)

    def _padded_seqs(self, size: int) -> int:
        return size // self.query_len if self.seqs is None else self.seqs

    # ---- per step ---------------------------------------------------------------------------
    def _lookup(self, live: LiveBatch) -> tuple[int, int] | str:
        m = live.meta
        return self._lookup_ints(live.num_seqs, m.max_query_len, m.block_tables.shape[1],
                                 m.max_seq_len, live.num_tokens)

    def _lookup_ints(self, b: int, max_query_len: int, width: int, max_seq_len: int,
                     num_tokens: int = 0) -> tuple[int, int] | str:
        """(padded token size, bucket) of the graph to replay, or why there is none."""
        if not self.enabled:
            return "cpu"
        if b == 0:
            return "empty"
        if max_query_len > self.query_len:
            return "query_len"  # the graph's grid has too few query blocks
        if width > self.buffers.max_blocks:
            return "block_table_width"
        bucket = bucket_max_seq_len(max_seq_len, self.seq_len_buckets)
        if bucket is None:
            return "max_seq_len"
        # Any bucket >= the live max_seq_len is valid; the smallest is preferred, a larger one
        # covers sizes whose capture failed in the smaller.
        if self.seqs is not None and b > self.seqs:
            return "seqs"
        for bk in self.seq_len_buckets[self.seq_len_buckets.index(bucket):]:
            table = self._tables.get(bk)
            if table is None:
                continue
            if self.seqs is None and b < len(table):
                return table[b] * self.query_len, bk
            if self.seqs is not None and num_tokens <= table[-1]:
                return table[bisect.bisect_left(table, num_tokens)], bk
        return "size"  # above the largest captured size (or nothing captured)

    def count_miss(self, why: str) -> None:
        """A call this runner's graphs do not take, under ``why`` (callers that find the miss
        before staging count it here too: no miss goes uncounted)."""
        self.eager_fallbacks += 1
        self.fallback_reasons[why] = self.fallback_reasons.get(why, 0) + 1

    def run(self, live: LiveBatch) -> Any:
        key = self._lookup(live)
        if not isinstance(key, str) and not self.buffers.sources_fit(live.extras):
            key = "source_rows"  # e.g. a row source from a target step larger than any graph
        if isinstance(key, str):  # compiled, no graph; counted so it cannot go unnoticed
            self.count_miss(key)
            return self.fn(live)
        size, bucket = key
        self.buffers.fill(live, size, self._padded_seqs(size), self.query_len, bucket)
        return self._replay(key, live.num_tokens, live.num_seqs)

    def run_host(self, hb: HostBatch, drafts_flat: torch.Tensor | None = None,
                 extras: dict[str, torch.Tensor] | None = None) -> Any:
        """``run`` for a host-built batch, staged in two copies (``capture.host_stage``), the
        extras (device tensors) copied in; None (counted) when no graph fits: the caller then
        builds device tensors and runs ``fn``."""
        key = self._lookup_ints(hb.num_seqs, hb.max_query_len, hb.width, hb.max_seq_len,
                                hb.num_tokens)
        if not isinstance(key, str) and not self.buffers.sources_fit(extras):
            key = "source_rows"
        if isinstance(key, str):
            self.count_miss(key)
            return None
        if self._stage is None:
            self._stage = HostStage(self.buffers)
        size, bucket = key
        self._stage.fill(hb, size, self._padded_seqs(size), self.query_len, bucket, drafts_flat,
                         extras)
        return self._replay(key, hb.num_tokens, hb.num_seqs)

    def _replay(self, key: tuple[int, int], t: int, b: int) -> Any:
        size = key[0]
        graph, out = self._graphs[key]
        seqs = self._padded_seqs(size)
        graph.replay()
        self.graph_replays += 1
        self.padded_rows += size - t
        padded, keep = (size, t) if self.output_rows == "tokens" else (seqs, b)
        if keep == padded and not self.clone_outputs:
            # Nothing padded (e.g. every tree step at batch 1): the outputs as they are. A slice
            # is an aten op of ~1-3 us host time per output, on the path where the GPU waits.
            return out

        def _slice(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == padded:
                x = x[:keep]
                return x.clone() if self.clone_outputs else x
            return x

        return _map_tensors(_slice, out)

    def stats(self) -> dict[str, Any]:
        return {"graph_replays": self.graph_replays, "padded_rows": self.padded_rows,
                "eager_fallbacks": self.eager_fallbacks,
                "fallback_reasons": dict(self.fallback_reasons),
                "captured_sizes": self.captured_sizes,
                "captured_graphs": sorted(self._graphs),
                "capture_failures": list(self.capture_failures)}
