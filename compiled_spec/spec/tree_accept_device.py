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


def early_tree_stage(acc: torch.Tensor,  # [b, 4, N] tokens, parents, depth, drawn per node
                     live32: torch.Tensor,  # [b] int32, 0 = padded row
                     start: torch.Tensor,  # [b] int64 each request's root position
                     slots: torch.Tensor,  # [b*q] int64 first-pass slots, fixed stride q
                     row0: torch.Tensor,  # [b] int64 the root's row in the target states
                     tables: torch.Tensor,  # [b, W] int32 block tables
                     covered: torch.Tensor,  # [b] int64 positions the tables cover
                     tslots: torch.Tensor,  # [b, N] int64 each node's tree slot
                     dslots: torch.Tensor,  # [b, D] int64 each depth's final slot
                     max_depth: int, q: int, topk: int, steps: int, page: int, forwarded: int,
                     ) -> tuple[torch.Tensor, ...]:
    """Everything an early tree step (engine/early_tree_graph.py) computes on the device between
    the verify and the draft: the acceptance, the first pass's rows laid out as the late path
    stages them (request i's n_acc + 1 rows back to back, padding after), the expansion's
    positions / slots / lengths from the device's roots (``TreeProposer._expand_rows``' rule),
    and the accepted nodes' target-KV moves. One function so that ``compile=True`` makes it a
    few fused kernels inside the graph instead of ~100 eager ones (H200 trace, eleventh session).
    -> (first pass: ids, positions, slots, rows [b*q], seq_lens [b], query_start_loc [b+1];
    expansion: positions, slots [S, b, K], seq_lens [S, b]; moves [2, b*D])."""
    b, dev = acc.shape[0], acc.device
    w = tables.shape[1]
    live = live32 != 0  # [b]
    # Padded rows read as zeros: a computed value, whose views Inductor reindexes. The unbind
    # of the input itself guarded on b != 1 (its view strides), and this stage compiled once
    # for batch 1 and again for the other sizes.
    tok, par, dep, drawn = torch.where(live[:, None, None], acc, 0).unbind(1)  # [b, N] each
    path, n_acc, bonus = accept_greedy_device(tok, par, dep, drawn, max_depth, live)
    ids, nodes, _ = first_pass_rows(tok, path, n_acc, bonus)  # [b, D+1] each
    m = torch.where(live, n_acc + 1, 0)  # [b] first-pass rows per request
    ends = torch.cumsum(m, dim=0)  # [b]
    qsl = torch.cat([ends.new_zeros(1), ends])  # [b+1]
    t = torch.arange(b * q, device=dev)  # [T] token rows
    seq = torch.searchsorted(ends, t, right=True).clamp(max=b - 1)  # [T] its request
    j = (t - (ends - m)[seq]).clamp(0, q - 1)  # [T] row within its request
    on = t < ends[-1]  # [T] live token rows
    at = seq * q + j  # [T] into the fixed [b, D+1] tables
    fp_ids = torch.where(on, ids.reshape(-1)[at], 0)
    fp_pos = torch.where(on, start[seq] + j, 0)
    fp_slots = torch.where(on, slots[at], -1)
    fp_rows = torch.where(on, row0[seq] + nodes.reshape(-1)[at], 0)
    fp_lens = torch.where(live, start + m, 0)
    root = start + n_acc + 1  # [b] the expansion's first position
    step = torch.arange(steps, device=dev)[:, None, None]  # [S, 1, 1]
    pos = (root[None, :, None] + step).expand(steps, b, topk)  # [S, b, K]
    # Built request-major, [b, S, K], so the table lookup reshapes a fresh tensor: reshaping
    # an [S, b, K] permute made Dynamo guard on b == 1 (whether it could be a view) and
    # compile batch 1 apart.
    slot_bsk = (root[:, None, None] + step.view(1, steps, 1) * topk
                + torch.arange(topk, device=dev))  # [b, S, K]
    col = (slot_bsk // page).clamp(max=w - 1).reshape(b, steps * topk)  # [b, S*K]
    block = tables.long().gather(1, col).view(b, steps, topk).permute(1, 0, 2)  # [S, b, K]
    slot_pos = slot_bsk.permute(1, 0, 2)  # [S, b, K]
    writes = (slot_pos < covered[None, :, None]) & live[None, :, None]
    ex_slots = torch.where(writes, block * page + slot_pos % page, -1)
    ex_pos = torch.where(live[None, :, None], pos, 0)
    ex_lens = torch.where(live, root + forwarded, 0)[None, :].expand(steps, b)  # [S, b]
    # Accepted row j moves the slot of root + path[j] to root + j + 1; every other row moves a
    # slot onto itself, one no accepted node moves to (staged), so destinations stay distinct.
    depth = torch.arange(max_depth, device=dev)  # [D]
    src = torch.where(depth[None, :] < n_acc[:, None], tslots.gather(1, path), dslots)
    moves = torch.stack([src.reshape(-1), dslots.reshape(-1)])  # [2, b*D]
    return fp_ids, fp_pos, fp_slots, fp_rows, fp_lens, qsl, ex_pos, ex_slots, ex_lens, moves
