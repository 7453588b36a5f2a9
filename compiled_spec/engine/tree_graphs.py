"""CUDA graphs for draft-tree engines: the target's tree verification and the tree proposer's
two calls, each a ``GraphRunner`` over padded static buffers (so misses are counted by reason,
exactly as for the chain components).

* ``target_tree_verify``: every request verifies ``num_draft_tokens`` (N) nodes, so one graph
  per batch size holds T = n * N tokens; a plain request inside a tree step (a one-node tree)
  has fewer query tokens and pads into it. Positions hold each node's root position and the
  extra ``depth`` [T] is added in the graph; ``tree_mask`` [T, N] is an extra, and every
  sequence's tree slots start at its first query row (``tree_start`` = seq_lens - q_len,
  computed in the graph: N before a tree's end, at a one-node request's only row, whose keys
  and block table end there). Padded token rows see no tree slot and belong to no sequence,
  padded sequences have q_len 0, seq_len 0 and slot -1 (``capture.pad``), so padding is
  inert. The tree runner stages its host lists straight into the buffers
  (``GraphRunner.run_host``).
* ``tree_draft_first_pass``: the draft over each request's root and accepted nodes (<= depth + 1
  tokens, causal); EAGLE-3's fc runs eagerly before it (``TreeProposer.propose``) over every
  target row of the step, into the row source ``hidden``, and the graph gathers the accepted
  rows itself by the host-staged ``rows`` (the tree's accepted nodes are not contiguous, and an
  index upload plus a gather outside the graph would sit between the step's host copy and the
  replay, where the GPU idles). The graph returns each request's last row only (what ``expand``
  reads). A first pass after a prefill is longer and runs compiled without a graph, counted as
  ``query_len``; one after a target step with more rows than the source holds, as
  ``source_rows``.
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
    """A tree forward with final positions as the verify graph takes it: depth 0 (the graph
    adds it to the positions) and the mask as extras (zeros pad them: no tree slot visible).
    ``meta.tree_start`` must be seq_lens - q_len, which the graph recomputes."""
    return LiveBatch(input_ids, positions, replace(meta, tree_start=None, tree_mask=None),
                     extras={"depth": torch.zeros_like(input_ids), "tree_mask": meta.tree_mask})


def tree_verify_fn(target_fn: Callable[..., Any], aux_ids: tuple[int, ...]
                   ) -> Callable[[LiveBatch], Any]:
    """The verify graph's body: rope positions root + depth, tree slots from each sequence's
    first query row (padded sequences: seq_len 0, q_len 0, so 0; they have no query rows)."""
    def fn(b: LiveBatch) -> Any:
        meta = replace(b.meta, tree_start=b.meta.first_query_positions(),
                       tree_mask=b.extras["tree_mask"])
        return target_fn(b.input_ids, b.positions + b.extras["depth"], meta, aux_ids)
    return fn


def register_tree_verify(reg: Register, target_fn: Callable[..., Any], tree: "TreeConfig",
                         batch_sizes: tuple[int, ...], max_blocks: int, device: torch.device,
                         aux_ids: tuple[int, ...]) -> GraphRunner:
    n, bm = tree.num_draft_tokens, batch_sizes[-1]
    bufs = StaticBuffers(bm * n, bm, max_blocks, device,
                         token_extras={"tree_mask": ((n,), torch.bool),
                                       "depth": ((), torch.int64)})
    return reg("target_tree_verify", tree_verify_fn(target_fn, aux_ids),
               [s * n for s in batch_sizes], bufs, query_len=n)


class TreeProposeGraphs:
    """The tree proposer's graphs (``TreeProposer.graph``): ``first_pass`` and ``expand``."""

    def __init__(self, reg: Register, prop: "TreeProposer", batch_sizes: tuple[int, ...],
                 max_blocks: int, dtype: torch.dtype) -> None:
        cfg, dev, bm = prop.cfg, prop.device, batch_sizes[-1]
        h = prop.draft.config.hidden_size
        q = cfg.num_steps + 1  # root + the deepest accepted path
        names = prop.layer_names

        def first_pass(b: LiveBatch) -> tuple[torch.Tensor, torch.Tensor]:  # [B, h] each
            hidden = b.extras["hidden"].index_select(0, b.rows)  # [T, h] the accepted rows
            # prop.step_fn is read per call: compiled or eager, as compile.use_compiled set it.
            feed, for_logits = prop.step_fn(b.input_ids, hidden, b.positions,
                                             {name: b.meta for name in names})  # [T, h] each
            # Each request's last row, what expand reads; a padded sequence's start and end are
            # the live token count, so its "last row" is a live one (and is sliced off).
            last = (b.meta.query_start_loc[1:] - 1).long()  # [B]
            return feed[last], for_logits[last]

        # The source holds every target row of the step before: a tree verify (<= N rows per
        # request) or a decode (one); a larger step, e.g. one that prefilled, is a counted miss.
        src_rows = bm * max(cfg.num_draft_tokens, q)
        fbufs = StaticBuffers(bm * q, bm, max_blocks, dev,
                              row_sources={"hidden": (src_rows, (h,), dtype)})
        self.first_pass = reg("tree_draft_first_pass", first_pass,
                              [s * q for s in batch_sizes], fbufs, query_len=q,
                              output_rows="seqs")
        K = cfg.topk
        ebufs = StaticBuffers(bm * K, bm, max_blocks, dev, num_steps=prop.expand_steps,
                              seq_extras={"feed": ((h,), dtype), "for_logits": ((h,), dtype)})
        self.expand = reg("tree_draft_expand", prop.expand, [s * K for s in batch_sizes], ebufs,
                          query_len=K, output_rows="seqs")

    def fc_out(self, rows: int) -> torch.Tensor | None:
        """[rows, h] the first pass's row source, where EAGLE-3's fc may write
        (``TreeProposer.precombine``); None when a step has more target rows than it holds."""
        src = self.first_pass.buffers.extras["hidden"]
        return src[:rows] if rows <= src.shape[0] else None
