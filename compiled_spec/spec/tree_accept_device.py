"""Greedy tree acceptance on the device, with fixed shapes and no host reads: the counterpart
of ``spec.tree.accept_paths`` for a proposal launched before the host reads the acceptance
(engine/early_tree.py). Capturable: a handful of gathers per tree level, no data-dependent
shapes, no .item()/.nonzero().

The rule is ``accept_paths``': a node is accepted when its token is the one drawn (the argmax)
at its parent and its parent is accepted. Siblings hold distinct tokens, so the accepted nodes
form one path with one node per depth, and since a parent's index is smaller than its child's,
the deepest accepted node is the one of largest index.
"""
from __future__ import annotations

import torch


def accept_greedy_device(tokens: torch.Tensor,  # [B, N] node tokens (root's unused)
                         parents: torch.Tensor,  # [B, N] root -1
                         depth: torch.Tensor,  # [B, N] root 0
                         drawn: torch.Tensor,  # [B, N] the target's argmax after each node
                         max_depth: int,
                         live: torch.Tensor | None = None,  # [B] bool: padded rows accept 0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (path [B, max_depth] tree indices of the accepted nodes by depth, 0 past the end
    (``accept_paths`` says -1 there; 0 is a valid gather index); n_acc [B]; bonus [B]: the token
    drawn at the deepest accepted node, the root if none)."""
    b, n = tokens.shape
    idx = torch.arange(n, device=tokens.device)  # [N]
    up = parents.clamp(min=0)  # the root is its own parent here (and always accepted)
    ok = (tokens == torch.gather(drawn, 1, up)) | (idx == 0)[None, :]  # [B, N]
    # Pointer jumping one level a pass: accepted = ok all the way up (max_depth - 1 passes
    # reach the deepest node, as in accept_paths).
    acc = ok
    for _ in range(max_depth - 1):
        acc = ok & torch.gather(acc, 1, up)
    acc = acc & (idx > 0)[None, :]  # the root is not a draft
    if live is not None:
        acc = acc & live[:, None]
    # A well-formed tree accepts one node per depth <= max_depth; the clamp keeps any later
    # index (last row of a fixed-stride batch) inside its buffers even for garbage trees.
    n_acc = acc.sum(dim=1).clamp(max=max_depth)  # [B]
    # The node of each depth d (1..max_depth): a one-hot [B, D, N] summed over the nodes
    # (a scatter by depth would write column 0 many times: nondeterministic on a GPU).
    d = torch.arange(1, max_depth + 1, device=tokens.device)  # [D]
    hit = acc[:, None, :] & (depth[:, None, :] == d[None, :, None])  # [B, D, N]
    path = (hit.long() * idx[None, None, :]).sum(dim=2)  # [B, D]
    last = (acc.long() * idx[None, :]).amax(dim=1)  # [B] the deepest accepted node, or 0
    bonus = torch.gather(drawn, 1, last[:, None])[:, 0]  # [B]
    return path, n_acc, bonus


def first_pass_rows(tokens: torch.Tensor,  # [B, N]
                    path: torch.Tensor,  # [B, D]
                    n_acc: torch.Tensor,  # [B]
                    bonus: torch.Tensor,  # [B]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft's first pass over a FIXED stride of D + 1 rows per request, as the late path
    stages it over the first n_acc + 1 of them: row j reads the token at position root + 1 + j
    (the accepted node of depth j + 1, then the bonus) paired with the target state of the
    row's node (the root, then the accepted nodes). -> (tokens [B, D+1], node of each row's
    hidden state [B, D+1], live rows [B, D+1] bool: j <= n_acc). Rows past n_acc repeat the
    bonus and the root: valid indices whose results nothing reads."""
    b, dd = path.shape
    j = torch.arange(dd + 1, device=path.device)  # [D+1]
    node_tok = torch.gather(tokens, 1, path)  # [B, D] the accepted nodes' tokens
    nxt = torch.cat([node_tok, bonus[:, None]], dim=1)  # [B, D+1]
    live = j[None, :] <= n_acc[:, None]  # [B, D+1]
    ids = torch.where(j[None, :] < n_acc[:, None], nxt, bonus[:, None])  # [B, D+1]
    zero = torch.zeros(b, 1, dtype=path.dtype, device=path.device)
    nodes = torch.where(live, torch.cat([zero, path], dim=1), 0)  # [B, D+1]
    return ids, nodes, live
