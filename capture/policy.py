"""Which shapes get a CUDA graph, and how a live batch maps onto one. Pure Python: no torch.cuda.

A CUDA graph replays fixed kernel launches: fixed tensor shapes, fixed pointers, and fixed *host
ints*. Our paged attention takes two host ints that shape its launch (``kernels/attention_triton``):

* ``max_query_len`` picks the query block size and the grid's query-block count. A graph captured
  with ``max_query_len = q`` only covers live batches whose sequences each have <= q query tokens
  (decode and draft steps: q = 1; verification: q = k + 1).
* ``max_seq_len`` picks the KV split count (flash-decoding) and the chunk each split covers.
  **Constraint: a graph captured for max_seq_len bucket B is valid for live batches whose
  max_seq_len <= B**, so a live batch replays the graph of the smallest bucket >= its max_seq_len,
  and padding rows must not raise that max (they carry seq_len 0, see ``capture.pad``).
  (The Triton kernel happens to stay correct above B because its last split runs to the end of
  each sequence, just slower; the reference kernel does not: it only gathers B keys. The layer
  enforces the stricter contract so any kernel honouring the AttentionMetadata docs is safe.)

Bucketing multiplies the number of graphs: with the Triton kernel one bucket (max_model_len) is
always correct and extra buckets only tune the split count for short contexts.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


def default_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """vLLM's capture list: 1, 2, 4, 8, then multiples of 8 up to ``max_batch_size``; the max
    itself is added when it is not on that grid, so every batch the scheduler can form has a
    graph."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch_size]
    sizes += list(range(8, max_batch_size + 1, 8))
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return tuple(sizes)


def _positive_sorted(name: str, values: tuple[int, ...]) -> tuple[int, ...]:
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: {v!r} is not a positive integer")
    return tuple(sorted(set(values)))


@dataclass(frozen=True)
class CapturePolicy:
    """What to capture. Empty ``batch_sizes`` / ``seq_len_buckets`` mean the defaults."""

    max_batch_size: int  # most requests per engine step (the scheduler's max_num_seqs)
    num_speculative_tokens: int  # k; 0 = vanilla decoding (verify == decode)
    max_model_len: int  # longest context; the default (and usual largest) max_seq_len bucket
    batch_sizes: tuple[int, ...] = ()  # requests per captured graph; () = default_batch_sizes
    seq_len_buckets: tuple[int, ...] = ()  # max_seq_len values captured; () = (max_model_len,)
    # Query lengths of one-sequence prompt-step graphs (``prefill_sizes``); () = none.
    prefill_sizes: tuple[int, ...] = ()
    # Token counts of the varlen graphs of prompt steps of several sequences (``mixed_sizes``;
    # () = none), each padded to max_batch_size sequences of at most mixed_query_len tokens.
    mixed_sizes: tuple[int, ...] = ()
    mixed_query_len: int = 0
    # Smaller draft counts verified instead of k (an adaptive policy's k shrinking): each gets
    # verify graphs of its own, w + 1 query rows per request (``verify_sizes(policy, w)``).
    verify_widths: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_model_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"num_speculative_tokens={k!r}: must be an integer >= 0")
        sizes = _positive_sorted("batch_sizes", tuple(self.batch_sizes)) or default_batch_sizes(
            self.max_batch_size)
        if sizes[-1] > self.max_batch_size:
            raise ValueError(f"batch_sizes {sizes}: {sizes[-1]} exceeds max_batch_size="
                             f"{self.max_batch_size} (the static buffers are sized by it)")
        buckets = _positive_sorted("seq_len_buckets", tuple(self.seq_len_buckets)) or (
            self.max_model_len,)
        if buckets[-1] > self.max_model_len:
            raise ValueError(f"seq_len_buckets {buckets}: {buckets[-1]} exceeds max_model_len="
                             f"{self.max_model_len}")
        pre = _positive_sorted("prefill_sizes", tuple(self.prefill_sizes))
        if pre and pre[-1] > self.max_model_len:
            raise ValueError(f"prefill_sizes {pre}: {pre[-1]} exceeds max_model_len="
                             f"{self.max_model_len}")
        mixed = _positive_sorted("mixed_sizes", tuple(self.mixed_sizes))
        q = self.mixed_query_len
        if mixed and (isinstance(q, bool) or not isinstance(q, int)
                      or not 1 <= q <= min(mixed[-1], self.max_model_len)):
            raise ValueError(f"mixed_query_len={q!r}: must be an integer in 1..min(largest "
                             f"mixed size {mixed[-1]}, max_model_len={self.max_model_len})")
        widths = _positive_sorted("verify_widths", tuple(self.verify_widths))
        if widths and widths[-1] >= k:
            raise ValueError(f"verify_widths {widths}: each must be below "
                             f"num_speculative_tokens={k}")
        object.__setattr__(self, "verify_widths", widths)
        # Frozen: normalise through object.__setattr__ (sorted, deduplicated, defaults filled in).
        object.__setattr__(self, "mixed_sizes", mixed)
        object.__setattr__(self, "prefill_sizes", pre)
        object.__setattr__(self, "batch_sizes", sizes)
        object.__setattr__(self, "seq_len_buckets", buckets)

    @property
    def verify_query_len(self) -> int:
        return self.num_speculative_tokens + 1


def decode_sizes(policy: CapturePolicy, single_via_verify: bool = False) -> list[int]:
    """Token counts of the captured target decode graphs: one token per request, T = n.

    ``single_via_verify`` (engines that verify chains): no decode graph for one request, whose
    decode steps (the first after a prefill, or speculation paused) replay the batch-1 verify
    graph instead, one query token in its k + 1 rows and the rest inert padding. Dynamo
    specializes dimensions of size 1, so a 1-token graph is a target compile of its own; on
    the H200 capturing it took 20-35 s of a start-up (ninth session)."""
    return [n for n in policy.batch_sizes if n > 1 or not single_via_verify]


def verify_sizes(policy: CapturePolicy, width: int | None = None) -> list[int]:
    """Token counts of the captured target verify graphs: [last token, k drafts] per request,
    T = n * (k + 1). Also fits the draft's first pass when every span is <= k + 1 tokens.
    ``width`` (one of ``policy.verify_widths``): the graphs verifying that many drafts."""
    if width is not None and width not in policy.verify_widths:
        raise ValueError(f"verify width {width} is not in verify_widths {policy.verify_widths}")
    q = policy.verify_query_len if width is None else width + 1
    return [n * q for n in policy.batch_sizes]


def draft_step_sizes(policy: CapturePolicy) -> list[int]:
    """Batch sizes of the one-token draft steps (and of the captured k-step draft loop)."""
    return list(policy.batch_sizes)


def prefill_sizes(max_tokens: int, verify_query_len: int, smallest: int = 16) -> tuple[int, ...]:
    """Query lengths of the one-sequence prompt-step graphs: powers of two from ``smallest``
    (above the verify graph's k + 1, which serves shorter steps) up to ``max_tokens``, the last
    one ``max_tokens`` itself when it is no power of two. A prompt of n tokens replays the
    smallest >= n, its rows past n inert (slot -1); why graphs: a prompt step without one was
    host-bound at 15-40 ms on the H200 (SmolLM2, ~360 launches through Python) against 1-3 ms
    for a replayed step. 0 tokens: none."""
    if max_tokens < 0:
        raise ValueError(f"prefill_sizes: max_tokens={max_tokens} is negative")
    out, q = [], max(smallest, 1)
    while q <= verify_query_len:
        q *= 2
    while q < max_tokens:
        out.append(q)
        q *= 2
    if max_tokens > verify_query_len:
        out.append(max_tokens)
    return tuple(out)


def mixed_sizes(max_tokens: int, smallest: int = 128) -> tuple[int, ...]:
    """Token counts of the varlen graphs of prompt steps of several sequences: powers of two
    from ``smallest`` up to ``max_tokens`` (the last one ``max_tokens`` itself when it is no
    power of two); none below ``smallest``. A step of n tokens replays the smallest >= n.
    Why: on the H200 such a step ran without a graph at 20-58 ms (issue 16, EAGLE-3 at batch
    64: 14 of them took 0.48 s of a 2.24 s run, where a decode step took ~3 ms)."""
    if max_tokens < 0:
        raise ValueError(f"mixed_sizes: max_tokens={max_tokens} is negative")
    out, t = [], max(smallest, 1)
    while t < max_tokens:
        out.append(t)
        t *= 2
    if max_tokens >= max(smallest, 1):
        out.append(max_tokens)
    return tuple(out)


def pad_to(n: int, sizes: list[int] | tuple[int, ...]) -> int | None:
    """Smallest size in ``sizes`` (sorted ascending) that is >= n; None when n is above the
    largest (the caller then runs the compiled function without a graph and counts it).
    n == 0 gives 0: an empty batch has nothing to pad and is never replayed."""
    if n < 0:
        raise ValueError(f"pad_to: n={n} is negative")
    if n == 0:
        return 0
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def padding_table(sizes: list[int] | tuple[int, ...], max_n: int | None = None) -> list[int]:
    """Precomputed ``pad_to`` for n = 0..max_n (vLLM's bs_to_padded_graph_size): one list index
    per step instead of a search. Only covers capturable n: max_n must be <= max(sizes)."""
    if not sizes:
        raise ValueError("padding_table: no sizes")
    sizes = sorted(sizes)
    top = sizes[-1]
    max_n = top if max_n is None else max_n
    if max_n > top:
        raise ValueError(f"padding_table: max_n={max_n} above the largest size {top}; "
                         "batches that large have no graph (check n < len(table) first)")
    table = [0] * (max_n + 1)
    i = 0
    for n in range(1, max_n + 1):
        while sizes[i] < n:
            i += 1
        table[n] = sizes[i]
    return table


def bucket_max_seq_len(max_seq_len: int, policy: CapturePolicy | tuple[int, ...]) -> int | None:
    """The max_seq_len host int to bake into (and select) a graph for a live batch: the smallest
    bucket >= the live batch's max_seq_len; None above the largest bucket (run without a graph).
    Padding rows carry seq_len 0, so the live rows alone decide the bucket."""
    buckets = policy.seq_len_buckets if isinstance(policy, CapturePolicy) else tuple(policy)
    if max_seq_len < 0:
        raise ValueError(f"bucket_max_seq_len: max_seq_len={max_seq_len} is negative")
    i = bisect.bisect_left(buckets, max(max_seq_len, 1))
    return buckets[i] if i < len(buckets) else None
