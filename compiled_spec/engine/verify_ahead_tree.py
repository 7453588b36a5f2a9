"""Verify ahead for draft trees (issue 15): an early tree step launches the NEXT step's tree
verify as soon as the host has read its acceptance, before the engine's bookkeeping, so the GPU
goes from the step's draft (the early tree graph) straight into the next verify.

The chain's counterpart is ``engine.verify_ahead`` (same switch, same counters). On the H200
(fifteenth session, batch 1) a tree step took 1.757 ms against 1.052 ms of verify and 0.498 ms
of propose: the GPU idled ~0.2 ms a step while the host appended tokens, checked stops,
scheduled and staged the next verify.

What the launch assumes, and why a wrong guess is harmless:

* Every request goes on: its next root is its bonus token at ``start + accepted + 1``, and the
  trees are the ones the early graph just drafted (row i = request i, as ``EarlyTree.finish``
  assigns them). The early step grew every request's blocks for the worst case, so the slots
  exist whatever was accepted.
* The next step takes it for the same requests in the same order, or for those that went on
  (finished requests' rows dropped, the fc redone over the rest), each at the launched root
  with the launched trees still its own (``TreeModelRunner.num_drafts_for``); anything else
  (a new request came in, a fault reset the runner) discards it, counted by reason.
* A discarded verify wrote target KV at each request's next root (the token that the request
  writes there next anyway) and at its tree slots past it (scratch, rewritten before any read),
  or into a finished request's own blocks, in stream order before anything reuses them. Its
  EAGLE-3 fc (``precombine``) is keyed by the hidden states it came from, so it is never taken
  for another step's.

Launched only from early tree steps (all requests verifying trees) whose
requests all take a tree next step whatever they accepted, and not when every request has just
emitted a stop token (nothing would take it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compiled_spec.engine.batch import to_device
from compiled_spec.engine.request import Request
from compiled_spec.engine.tree_verify import (TreeVerify, tree_host_batch, tree_host_lists,
                                              verify_tree_host)
from compiled_spec.engine.verify_ahead import Ahead, VerifyAhead, _count
from compiled_spec.profile import phase
from compiled_spec.spec.tree_proposer import DraftTree

if TYPE_CHECKING:
    from compiled_spec.engine.tree_runner import TreeModelRunner


@dataclass
class _LaunchedTree:
    req_ids: list[int]
    tree: DraftTree  # the trees it verified, the early graph's outputs
    verify: TreeVerify


class TreeVerifyAhead(VerifyAhead):
    runner: "TreeModelRunner"

    def take(self, reqs: list[Request], num_new: list[int]) -> Ahead | None:
        """The chain path of a tree engine (a prefill, or no trees this step)."""
        if isinstance(self._launched, _LaunchedTree):
            self._launched = None
            _count(self.stats.discarded, "not_tree")
            return None
        return super().take(reqs, num_new)

    def launch_tree(self, reqs: list[Request], starts: list[int],
                    new_tokens: list[list[int]],  # per request: accepted tokens, then the bonus
                    tree: DraftTree) -> DraftTree:
        """After an early tree step's acceptance is read: the next step's verify of ``tree``.
        Returns the trees the next step is to use: ``tree`` itself, or when launched a copy
        made before the verify (the early graph's outputs may share memory with the verify
        graph's, so a replay can overwrite them, and a discarded launch leaves them in use)."""
        self._launched = None
        r = self.runner
        roots = [s + len(toks) for s, toks in zip(starts, new_tokens)]
        why = self._why_not_batch(reqs) or self._why_not_ending(reqs, new_tokens)
        if why is None and tree.tokens.shape[0] != len(reqs):
            why = "rows"
        if why is None and not all(r.takes_tree_at(q, root + 1)
                                   and r.covered(q) >= root + r.lookahead
                                   for q, root in zip(reqs, roots)):
            why = "short"  # a request would not take a tree next step
        if why is not None:
            _count(self.stats.skipped, why)
            return tree
        n_nodes = r.tree.num_draft_tokens
        host = tree_host_lists(r, [(q.req_id, root, toks[-1], n_nodes)
                                   for q, root, toks in zip(reqs, roots, new_tokens)])
        rows = list(range(len(reqs)))
        hb = tree_host_batch(r, host, roots, rows)
        g = r.early.graph
        if g is not None and g.holds_tree(tree.tokens, tree.mask):
            # The early graph's trees, in memory of its own (early_tree_graph.py): valid until
            # its next replay, which comes after everything reading them.
            tree_info = g.tree_info(len(reqs))  # [3, B, N]
        else:  # copied before the verify: graph outputs its replay may reuse
            tree_info = torch.stack([tree.tokens, tree.parents, tree.depth])  # [3, B, N]
            tree = DraftTree(tree_info[0], tree_info[1], tree_info[2], tree.mask.clone())
        with phase("verify"):
            logits, hidden = verify_tree_host(r, hb, tree, tree.depth, tree.mask)
        self._launched = _LaunchedTree(
            req_ids=[q.req_id for q in reqs], tree=tree,
            verify=TreeVerify(in_tree=[True] * len(reqs), starts=roots, base=host[1],
                              qsl=host[3], dst=None, tree_info=tree_info, positions=None,
                              logits=logits, target_hidden=hidden))
        self.stats.launched += 1
        return tree

    def take_tree(self, reqs: list[Request]) -> TreeVerify | None:
        """The launched verify for this tree step's batch (all of it, or the requests that went
        on, in order: finished requests' rows dropped), or None (discarded, counted)."""
        a, self._launched = self._launched, None
        if a is None:
            return None
        keep = self._kept(reqs, a.req_ids if isinstance(a, _LaunchedTree) else [])
        if keep is None:
            return None
        r, v = self.runner, a.verify
        if r._tree is not a.tree or any(
                q.num_computed != v.starts[i] or r._tree_row.get(q.req_id) != i
                or not r.num_drafts_for(q) for q, i in zip(reqs, keep)):
            _count(self.stats.discarded, "state")
            return None
        if len(keep) == len(a.req_ids):
            self.stats.taken += 1
            return v
        self.stats.taken_subset += 1
        n = r.tree.num_draft_tokens
        rows, hidden = self._kept_hidden(v.target_hidden, keep, n)  # rows: [T']
        starts = [v.starts[i] for i in keep]
        return TreeVerify(in_tree=[True] * len(keep), starts=starts,
                          base=[s for s in starts for _ in range(n)],
                          qsl=[j * n for j in range(len(keep) + 1)], dst=None,
                          tree_info=v.tree_info[:, to_device(keep, r.device)], positions=None,
                          logits=v.logits.index_select(0, rows), target_hidden=hidden)
