"""A tree step's verify forward (``TreeModelRunner``): the host lists of every request's tree
(its root, then N - 1 drafted nodes, or a one-node tree for a request decoding plainly), staged
into the tree-verify graph's buffers (CUDA graphs, or their CPU emulation) or built as device
tensors, the target forward with tree attention, and the logits acceptance reads. Shared by the
step itself and by verify ahead (``engine.verify_ahead_tree``), which stages the next step's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from capture.host_stage import HostBatch
from compiled_spec.engine.batch import metadata_to_device, to_device
from compiled_spec.engine.request import Request
from compiled_spec.kv_cache import extend_slots
from compiled_spec.profile import phase
from compiled_spec.spec.tree_proposer import DraftTree

if TYPE_CHECKING:
    from compiled_spec.engine.tree_runner import TreeModelRunner

# (input ids, root positions, slots, query_start_loc, tables) of a tree step
HostLists = tuple[list[int], list[int], list[int], list[int], list[list[int]]]


@dataclass
class TreeVerify:
    """A tree step's verify, as its acceptance reads it."""

    in_tree: list[bool]  # per request: verifies a tree (else one node, a plain decode)
    starts: list[int]  # per request: its root's position (its last token's)
    base: list[int]  # [T] each row's root position
    qsl: list[int]  # [B + 1] each request's rows
    dst: torch.Tensor | None  # [B_t * N] the trees' rows in a mixed batch; None: all trees
    tree_info: torch.Tensor  # [3, B_t, N] tokens, parents, depths (copied before the verify)
    positions: torch.Tensor | None  # [T] rope positions; None: base + depth
    logits: torch.Tensor  # [T, V]
    target_hidden: Any  # [T, h] (per aux layer for EAGLE-3)


def tree_host_lists(rn: "TreeModelRunner", entries: list[tuple[int, int, int, int]]
                    ) -> HostLists:
    """(input ids, root positions, slots, query_start_loc, tables) of a tree step, from
    (req_id, root position, root token, nodes) per request; non-root ids are placeholders."""
    alloc = rn.allocator
    page = alloc.page_size
    host_ids, base, slots, qsl, tables = [], [], [], [0], []
    for rid, root, root_tok, n in entries:
        host_ids.append(root_tok)
        host_ids.extend([0] * (n - 1))
        base.extend([root] * n)
        table = alloc.tables[rid]
        extend_slots(slots, table, page, root, root + n)
        qsl.append(qsl[-1] + n)
        tables.append(table)
    return host_ids, base, slots, qsl, tables


def tree_host_batch(rn: "TreeModelRunner", host: HostLists, starts: list[int],
                    tree_rows: list[int]) -> HostBatch:
    """An all-tree step's batch for the tree-verify graph's buffers; the drafted nodes' ids
    are gathered there from the trees' rows ``tree_rows``."""
    host_ids, base, slots, qsl, tables = host
    n_nodes = rn.tree.num_draft_tokens
    # Request i verifying tree row i (the launch ahead's batch, an unchanged one): its nodes
    # 1.. take row i of the tokens [n, N] in one strided copy (``verify_tree_host``).
    grid = (n_nodes, 1) if tree_rows == list(range(len(tree_rows))) else None
    return HostBatch(input_ids=host_ids, positions=base, slots=slots,
                     seq_lens=[r + n_nodes for r in starts], query_start_loc=qsl,
                     tables=tables, max_query_len=n_nodes,
                     max_seq_len=max(starts) + n_nodes, draft_grid=grid,
                     **rn._draft_rows(tree_rows))


def verify_tree_host(rn: "TreeModelRunner", hb: HostBatch, tree: DraftTree,
                     t_depth: torch.Tensor, t_mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The tree-verify graph over ``hb``: (logits [T, V], the hidden the draft reads). Its
    host phases are the chain verify's (``ModelRunner._verify``): build (up to here), replay
    (staging and launch), logits."""
    n_nodes, clock = rn.tree.num_draft_tokens, rn.clock
    clock.mark("verify_build")
    rn.gpu_probe.before()
    hidden, aux = rn.target_fn.run_tree_host(
        hb, tree.tokens if hb.draft_grid else tree.tokens.reshape(-1),  # [n, N] or flat
        {"depth": t_depth.reshape(-1), "tree_mask": t_mask.reshape(-1, n_nodes)})
    rn.gpu_probe.after()
    clock.mark("verify_replay")
    out = tree_logits(rn, hidden, aux)
    clock.mark("verify_logits")
    return out


def tree_logits(rn: "TreeModelRunner", hidden: torch.Tensor,  # [T, h]
                aux: Any) -> tuple[torch.Tensor, Any]:
    """(logits [T, V], the hidden the draft reads); EAGLE-3's fc issued for the next proposal."""
    # [T, V] the tree graph's (model dtype: argmax needs no upcast, samplers upcast the rows
    # they read), else read out eagerly
    logits = rn._logits_fn(upcast=False)(hidden)
    if rn.aux_layer_ids:  # the next proposal's fc, before the acceptance's host wait
        rn.proposer.precombine(aux)
    return logits, aux if rn.aux_layer_ids else hidden


def mixed_inputs(host_ids: list[int], node_dst: list[int], t_tok: torch.Tensor,
                 t_depth: torch.Tensor, t_mask: torch.Tensor, dev: torch.device
                 ) -> tuple[torch.Tensor, ...]:
    """A step mixing trees and one-node (plain) requests: (the trees' rows dst [B_t * N],
    input ids [T], the trees' tokens with their roots [B_t, N], depth [T], tree mask [T, N])."""
    n_nodes = t_tok.shape[1]
    dst = (to_device(node_dst, dev)[:, None] + torch.arange(n_nodes, device=dev)).reshape(-1)
    input_ids = to_device(host_ids, dev)  # [T]
    tok = t_tok.clone()  # [B_t, N]
    tok[:, 0] = input_ids[dst.view(-1, n_nodes)[:, 0]]  # the roots
    input_ids[dst] = tok.reshape(-1)
    depth = torch.zeros(len(host_ids), dtype=torch.int64, device=dev)
    depth[dst] = t_depth.reshape(-1)
    mask = torch.zeros(len(host_ids), n_nodes, dtype=torch.bool, device=dev)
    mask[:, 0] = True  # every node (and every one-node tree) sees its root
    mask[dst] = t_mask.reshape(-1, n_nodes)
    return dst, input_ids, tok, depth, mask


@torch.inference_mode()
def warm_mixed_verify(rn: "TreeModelRunner") -> None:
    """Run a mixed step's own device work once at start-up, on a dummy batch (one tree, one
    one-node request; slots -1: no KV written): its staging, the tree-verify graph fed from
    device tensors, the logits and the acceptance's gathers and host copy. Only a step where
    some requests verify trees and others decode plainly (``not_all_tree``: a request within
    two tokens of its end) runs these eager kernels; on the H200 their first launch in the
    process (lazy CUDA module loading) cost ~70 ms, one 160-230 ms outlier step per bench."""
    n, dev = rn.tree.num_draft_tokens, rn.device
    t_tok = torch.zeros(1, n, dtype=torch.int64, device=dev)
    t_mask = torch.zeros(1, n, n, dtype=torch.bool, device=dev)
    t_mask[:, :, 0] = True
    # the trees' rows gathered, as after an early step whose batch lost a request (its trees
    # were drafted for every request: stage_and_verify's gathers)
    rows = to_device([0], dev)
    t_tok, t_mask = t_tok[rows], t_mask[rows]
    dst, input_ids, tok, depth, mask = mixed_inputs([0] * (n + 1), [0], t_tok, t_tok, t_mask,
                                                    dev)
    tree_info = torch.stack([tok, t_tok, t_tok])
    # Tables cover the keys (the tree's n, the one-node request's 1): a one-block table for n
    # keys past two pages made the kernel read entries past the tensor (an illegal address on
    # the H200 at 48 nodes).
    base_t, meta = metadata_to_device(dev, [0] * (n + 1), [-1] * (n + 1), [n, 1], [0, n, n + 1],
                                      [[0] * rn.allocator.blocks_for(n), [0]], n, n)
    meta = replace(meta, tree_start=meta.first_query_positions(), tree_mask=mask)
    hidden, aux = rn.target_fn(input_ids, base_t + depth, meta, rn.aux_layer_ids)
    logits, _ = tree_logits(rn, hidden, aux)
    if rn.aux_layer_ids:
        rn.proposer.base._pre = None  # the dummy's precombined fc: never a proposal's input
    drawn = logits.argmax(dim=-1)
    at_nodes = drawn[dst].view(-1, n)
    torch.cat([tree_info.reshape(-1), at_nodes.reshape(-1),
               drawn[to_device([n], dev)]]).cpu().numpy()


def stage_and_verify(rn: "TreeModelRunner", reqs: list[Request]) -> TreeVerify:
    """The step's verify of the trees its requests hold (``rn._tree``, rows ``rn._tree_row``),
    requests without one decoding plainly as one-node trees."""
    n_nodes, dev = rn.tree.num_draft_tokens, rn.device
    with phase("prepare"):
        in_tree = [rn.num_drafts_for(r) > 0 for r in reqs]
        starts = [r.num_computed for r in reqs]  # position L-1 of the last token
        host = tree_host_lists(rn, [
            (r.req_id, s, r.token_ids[s], n_nodes if t else 1)
            for r, s, t in zip(reqs, starts, in_tree)])
        host_ids, base, slots, qsl, tables = host
        node_dst = [qsl[i] for i, t in enumerate(in_tree) if t]
        tree_rows = [rn._tree_row[r.req_id] for r, t in zip(reqs, in_tree) if t]
        tree = rn._tree
        all_tree = all(in_tree)
        # The trees' rows in this step's order; as proposed (no gathers) when unchanged.
        if tree_rows == list(range(tree.tokens.shape[0])):
            t_tok, t_par, t_depth, t_mask = tree.tokens, tree.parents, tree.depth, tree.mask
        else:
            rows_t = to_device(tree_rows, dev)
            t_tok, t_par = tree.tokens[rows_t], tree.parents[rows_t]
            t_depth, t_mask = tree.depth[rows_t], tree.mask[rows_t]  # [B_t, N], [B_t, N, N]
        # CUDA graphs (or their CPU emulation): the host lists go straight into the verify
        # graph's buffers, the drafted nodes' ids gathered there from the trees.
        use_host = all_tree and hasattr(rn.target_fn, "run_tree_host")
        positions = None
        if use_host:
            dst, tok = None, t_tok  # the roots come from the host lists
            hb = tree_host_batch(rn, host, starts, tree_rows)
        elif all_tree:  # every request verifies a tree: its rows are the batch as they are
            dst = None
            tok = t_tok.clone()  # [B, N]
            tok[:, 0] = to_device(host_ids[::n_nodes], dev)  # the roots
            input_ids = tok.view(-1)  # [T]
            depth, mask = t_depth.reshape(-1), t_mask.reshape(-1, n_nodes)
        else:  # trees and one-node (plain) requests mixed: trees scattered into place
            dst, input_ids, tok, depth, mask = mixed_inputs(host_ids, node_dst, t_tok, t_depth,
                                                            t_mask, dev)
        # What acceptance reads after the verify, copied before it: the trees are graph
        # outputs of the proposer, valid only until the verify's replay (capture.emulate).
        tree_info = torch.stack([tok, t_par, t_depth])  # [3, B_t, N]
        if not use_host:
            # A tree's keys end after its N slots, a one-node request's after its root: its
            # table holds no more (keys past it were read through entries past the table).
            base_t, meta = metadata_to_device(
                dev, base, slots, [s + (n_nodes if t else 1) for s, t in zip(starts, in_tree)],
                qsl, tables, n_nodes, max(starts) + n_nodes)
            positions = base_t + depth  # rope position L-1 + depth
            meta = replace(meta, tree_start=meta.first_query_positions(), tree_mask=mask)
    with phase("verify"):
        if use_host:
            logits, target_hidden = verify_tree_host(rn, hb, tree, t_depth, t_mask)
        else:
            hidden, aux = rn.target_fn(input_ids, positions, meta, rn.aux_layer_ids)
            logits, target_hidden = tree_logits(rn, hidden, aux)
    return TreeVerify(in_tree=in_tree, starts=starts, base=base, qsl=qsl, dst=dst,
                      tree_info=tree_info, positions=positions, logits=logits,
                      target_hidden=target_hidden)
