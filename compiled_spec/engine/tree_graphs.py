"""CUDA graphs for draft-tree engines: the target's tree verification and the tree proposer's
two calls, each a ``GraphRunner`` over padded static buffers (so misses are counted by reason,
exactly as for the chain components).

* ``target_tree_verify``: every request verifies ``num_draft_tokens`` (N) nodes, so one graph
  per batch size holds T = n * N tokens; a plain request inside a tree step (a one-node tree)
  has fewer query tokens and pads into it. ``tree_start`` [B] and ``tree_mask`` [T, N] travel
  as extras: padded token rows see no tree slot and belong to no sequence, padded sequences
  have q_len 0, seq_len 0 and slot -1 (``capture.pad``), so padding is inert.
* ``tree_draft_first_pass``: the draft over each request's root and accepted nodes (<= depth + 1
  tokens, causal); EAGLE-3's fc runs eagerly before it (``TreeProposer.propose``). A first pass
  after a prefill is longer and runs compiled without a graph, counted as ``query_len``.
* ``tree_draft_expand``: ``TreeProposer.expand``, i.e. layer 1's top-k, every expansion (K
  nodes per request, tree attention, metadata of all steps built on the host beforehand) and
  node selection, as one graph per batch size; outputs are per request.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from capture import GraphRunner, LiveBatch, StaticBuffers
from compiled_spec.attention_metadata import AttentionMetadata

if TYPE_CHECKING:
    from compiled_spec.spec.tree import TreeConfig
    from compiled_spec.spec.tree_proposer import TreeProposer

Register = Callable[..., GraphRunner]  # GraphRegistry.register with the engine's defaults


def tree_live(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
              ) -> LiveBatch:
    """A tree forward's inputs with the tree fields as extras, which is how static buffers pad
    them (zeros: no tree slot visible, tree_start 0)."""
    return LiveBatch(input_ids, positions, replace(meta, tree_start=None, tree_mask=None),
                     extras={"tree_start": meta.tree_start, "tree_mask": meta.tree_mask})


def _tree_meta(b: LiveBatch) -> AttentionMetadata:
    return replace(b.meta, tree_start=b.extras["tree_start"], tree_mask=b.extras["tree_mask"])


def register_tree_verify(reg: Register, target_fn: Callable[..., Any], tree: "TreeConfig",
                         batch_sizes: tuple[int, ...], max_blocks: int, device: torch.device,
                         aux_ids: tuple[int, ...]) -> GraphRunner:
    n, bm = tree.num_draft_tokens, batch_sizes[-1]
    bufs = StaticBuffers(bm * n, bm, max_blocks, device,
                         token_extras={"tree_mask": ((n,), torch.bool)},
                         seq_extras={"tree_start": ((), torch.int32)})
    fn = lambda b: target_fn(b.input_ids, b.positions, _tree_meta(b), aux_ids)  # noqa: E731
    return reg("target_tree_verify", fn, [s * n for s in batch_sizes], bufs, query_len=n)


class TreeProposeGraphs:
    """The tree proposer's graphs (``TreeProposer.graph``): ``first_pass`` and ``expand``."""

    def __init__(self, reg: Register, prop: "TreeProposer", batch_sizes: tuple[int, ...],
                 max_blocks: int, dtype: torch.dtype) -> None:
        cfg, dev, bm = prop.cfg, prop.device, batch_sizes[-1]
        h = prop.draft.config.hidden_size
        q = cfg.num_steps + 1  # root + the deepest accepted path
        names = prop.layer_names

        def first_pass(b: LiveBatch) -> tuple[torch.Tensor, torch.Tensor]:  # [T, h] each
            # prop.step_fn is read per call: compiled or eager, as compile.use_compiled set it.
            return prop.step_fn(b.input_ids, b.extras["hidden"], b.positions,
                                {name: b.meta for name in names})

        fbufs = StaticBuffers(bm * q, bm, max_blocks, dev,
                              token_extras={"hidden": ((h,), dtype)})
        self.first_pass = reg("tree_draft_first_pass", first_pass,
                              [s * q for s in batch_sizes], fbufs, query_len=q)
        K = cfg.topk
        ebufs = StaticBuffers(bm * K, bm, max_blocks, dev, num_steps=prop.expand_steps,
                              seq_extras={"feed": ((h,), dtype), "for_logits": ((h,), dtype)})
        self.expand = reg("tree_draft_expand", prop.expand, [s * K for s in batch_sizes], ebufs,
                          query_len=K, output_rows="seqs")
