"""The draft tree's glue (EAGLE-2 dynamic trees, spec/tree_proposer.py) as modules of their own:
layer 1's top-k, one expansion, the node selection, and an early tree step's device-side staging.

Why modules and not the tree proposer's methods: compile=True compiles each as a callable of its
own, and precompile (compiled_spec/precompile.py) saves a compiled callable only when it is a
module's method whose state Dynamo's guards can serialize. The proposer holds the engine's
allocator, graphs and the other compiled callables, which they cannot; these hold only the draft
and the tree's shape.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from capture.buffer_writes import Region, write_regions
from compiled_spec.attention_metadata import AttentionMetadata
from compiled_spec.draft.model import EagleDraft
from compiled_spec.spec.tree import ancestor_mask, select_nodes
from compiled_spec.spec.tree_accept_device import early_tree_stage
import kernels.ops  # noqa: F401  (registers torch.ops.compiled_spec.row_topk)


class TreeGlue(torch.nn.Module):
    def __init__(self, draft: EagleDraft, topk: int, num_steps: int,
                 num_draft_tokens: int) -> None:
        super().__init__()
        self.draft = draft
        self.topk, self.num_steps, self.num_draft_tokens = topk, num_steps, num_draft_tokens

    def head(self, for_logits: torch.Tensor,  # [B, h]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer 1: the K best first drafts, (log-probabilities [B, K], target ids [B, K])."""
        logits = self.draft.compute_logits(for_logits, fp32=False)  # [B, Vd]
        score, tok = torch.ops.compiled_spec.row_topk_logprob(logits, self.topk)
        return score, self.draft.draft_to_target(tok)

    def expand_step(self, x_tok: torch.Tensor,  # [B, K] the frontier's tokens
                    x_hid: torch.Tensor,  # [B, K, h] their input hidden states
                    x_score: torch.Tensor,  # [B, K] their cumulative scores
                    x_fm: torch.Tensor,  # [B, K, F] their tree masks (ancestors' slots)
                    own_slot: torch.Tensor,  # [1, K, F] this expansion's nodes' own slots
                    positions: torch.Tensor,  # [B*K]
                    meta: AttentionMetadata,  # tree_start set; tree_mask is built here
                    ) -> tuple[torch.Tensor, ...]:
        """One expansion: the frontier through the draft, each node's K best children
        (c_tok, c_score [B, K*K]; child i*K + j hangs off frontier node i), and the next
        frontier: this layer's K best (``sel`` [B, K] within the layer) with the tokens, scores,
        input states (their parents' outputs) and masks (their parents') it carries on."""
        b, K, h = x_hid.shape
        # Each node also sees its own slot: a mask OR with a constant built at init (an
        # index_put would copy a Python scalar from host memory, which CUDA graph capture
        # refuses: found on the H200).
        fm = x_fm | own_slot  # [B, K, F]
        meta = replace(meta, tree_mask=fm.reshape(b * K, fm.shape[-1]))
        new_feed, fl = self.draft(x_tok.reshape(-1), x_hid.reshape(b * K, h), positions,
                                  {n: meta for n in self.draft.layer_names})
        logits = self.draft.compute_logits(fl, fp32=False)  # [B*K, Vd]
        # Top-k with a fixed tie rule (smaller id first; kernels.ops.row_topk): eager and
        # compiled trees pick the same children. Their log-probabilities come from the
        # top-k's own launch: a log_softmax over the 32k vocabulary cost 5 kernels per
        # expansion (H100, thirty-sixth session).
        c_score, c_tok = torch.ops.compiled_spec.row_topk_logprob(logits, K)
        c_score = (x_score[:, :, None] + c_score.view(b, K, K)).reshape(b, K * K)
        # View the top-k's output, not the id map's: a view of a computed (unrealized) value
        # makes Inductor compare K*K with B*K*K, a guard that fails between batch 1 and 2 and
        # compiled this callable twice.
        c_tok = self.draft.draft_to_target(c_tok.view(b, K * K))
        sel = torch.ops.compiled_spec.row_topk(c_score, K)[1]  # [B, K]
        up = (sel // K)[:, :, None]  # [B, K, 1] each one's parent in this frontier
        return (c_tok, c_score, sel, torch.gather(c_tok, 1, sel), torch.gather(c_score, 1, sel),
                torch.gather(new_feed.view(b, K, h), 1, up.expand(-1, -1, h)),
                torch.gather(fm, 1, up.expand(-1, -1, fm.shape[-1])))

    def finish(self, cand_tok: list[torch.Tensor],  # per layer [B, K] then [B, K*K]
               cand_score: list[torch.Tensor],  # the same shapes
               sels: list[torch.Tensor],  # per expansion [B, K]: its next frontier
               ) -> tuple[torch.Tensor, ...]:
        """Node selection over every layer's candidates -> (tokens, parents, depth, mask)."""
        dev = cand_tok[0].device
        K, b = self.topk, cand_tok[0].shape[0]
        # Candidate ids: layer 1 is 0..K-1, layer s >= 2 starts at K + (s-2) K^2. Layer s's
        # parents are layer s-1's frontier: layer 1 whole, then each expansion's selection.
        parent = [torch.full((b, K), -1, dtype=torch.int64, device=dev)]
        frontier = torch.arange(K, device=dev).expand(b, K)
        for i in range(len(cand_tok) - 1):
            parent.append(frontier[:, :, None].expand(b, K, K).reshape(b, K * K))
            frontier = K + i * K * K + sels[i]
        n_cand = K + (len(cand_tok) - 1) * K * K
        # Candidate depths: K of depth 1, then K*K per later layer (no host copy, capture-safe).
        c = torch.arange(n_cand, device=dev)
        cand_depth = torch.where(c < K, 1, 2 + torch.div(c - K, K * K, rounding_mode="floor"))
        n = self.num_draft_tokens - 1
        top, par, dep = select_nodes(torch.cat(cand_score, 1), cand_depth.expand(b, -1),
                                     torch.cat(parent, 1), n)
        tokens = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=dev),
                            torch.gather(torch.cat(cand_tok, 1), 1, top)], 1)  # [B, N]
        parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=dev), par], 1)
        depth = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=dev), dep], 1)
        return tokens, parents, depth, ancestor_mask(parents, self.num_steps)


class EarlyTreeStage(torch.nn.Module):
    """``spec.tree_accept_device.early_tree_stage`` as a module's forward (see above): its nine
    layout outputs and then ``extra`` are written into the late graphs' static buffers
    ``flats`` at ``regions`` (``capture.buffer_writes``), and only the KV moves are returned:
    compiled, the kernels that compute them store them there. The regions are the module's
    (set once by engine/early_tree_graph.py, the same for every batch size): host ints Dynamo
    takes as constants, where arguments would be traced as symbols (and Inductor cannot lower
    a slice at a symbolic offset of a mutated buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.regions: tuple[Region, ...] = ()

    def forward(self, *args: Any, flats: tuple[torch.Tensor, ...],
                extra: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:  # [2, b*D]
        out = early_tree_stage(*args)
        write_regions(flats, self.regions, (*out[:9], *extra))
        return out[9]
