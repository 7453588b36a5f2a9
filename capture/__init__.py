"""CUDA-graph capture: the size policy, inert padding into static buffers, and dummy-run capture.

* ``capture.policy``: which batch sizes / max_seq_len buckets get a graph and how a live batch
  maps onto one (pure Python).
* ``capture.pad``: padding a live batch with inert rows (slot -1, q_len 0, seq_len 0, block 0)
  into preallocated ``StaticBuffers``.
* ``capture.cuda_graphs``: ``GraphRunner`` (capture at start-up, padded replay, counted eager
  fallbacks).
* ``capture.errors``: ``CaptureError`` and ``describe_error`` (a failure's innermost cause and
  where it was raised, in every failure record).
* ``capture.registry``: ``GraphRegistry`` (the components on one pool) and ``assert_captured``
  (every component, the draft included, has graphs).

``python -m capture.selfcheck_cuda`` checks replay == eager on a CUDA machine.
"""
from capture.cuda_graphs import GraphRunner
from capture.errors import CaptureError
from capture.pad import (LiveBatch, StaticBuffers, pad_batch, pad_block_tables, pad_dim,
                         pad_metadata, pad_query_start_loc, stack_steps)
from capture.registry import GraphRegistry, assert_captured
from capture.policy import (CapturePolicy, bucket_max_seq_len, decode_sizes, default_batch_sizes,
                            draft_step_sizes, mixed_sizes, pad_to, padding_table,
                            prefill_sizes, verify_sizes)

__all__ = [
    "CaptureError", "CapturePolicy", "GraphRegistry", "GraphRunner", "LiveBatch", "StaticBuffers",
    "assert_captured", "bucket_max_seq_len", "decode_sizes", "default_batch_sizes",
    "draft_step_sizes", "mixed_sizes", "pad_batch", "pad_block_tables", "pad_dim", "pad_metadata",
    "pad_query_start_loc", "pad_to", "padding_table", "prefill_sizes", "stack_steps",
    "verify_sizes",
]
