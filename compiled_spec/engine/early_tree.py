"""Early tree propose (issue 15): a draft-tree step launches its next proposal (first
pass and expansion, one graph: ``early_tree_graph``) right after the tree verify, BEFORE the
host reads the step's acceptance, so the draft runs on the GPU while the host accepts, does the
engine's bookkeeping and stages the next verify. The chain's counterpart is
``early_propose``; this shares its switch (``SpecConfig.early_propose``) and its counters
(``llm.stats.early_propose``).

The graph computes the acceptance itself from the verified trees and the target's token per
node (its argmax, or for sampled requests vanilla's draw there); the host computes the same
from the step's one device-to-host copy of those numbers (``accept_paths``), so both agree by
construction. The accepted nodes' target-KV moves
are made in the graph too, after the draft (which reads the target's hidden states, never its
KV), so an early step leaves the host no moves to make before the next verify.

A step goes early when every request verifies a tree, the
adaptive policy (if any) chose to draft in this step, an early graph fits the batch, and every
request's tree slots stay inside max_model_len whatever it accepts (its blocks then grow for the
worst case, all D accepted). Anything else runs the late path, the
reason counted. Sampled requests go early too (fifty-third session): the token drawn at each
node is then vanilla's draw there (the late path's), not the argmax, and the graph and the host
accept along the tree with it as they do with the argmax (the coupling rule, exact for the
tree's deterministic drafts). So do requests with logprobs: every node's are computed on the
device before the replay.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from compiled_spec.engine.early_propose import EarlyPath, HostCopy
from compiled_spec.engine.request import Request
from compiled_spec.profile import phase
from compiled_spec.spec.tree_proposer import DraftTree

if TYPE_CHECKING:
    from compiled_spec.engine.early_tree_graph import EarlyTreeGraphs
    from compiled_spec.engine.tree_runner import TreeModelRunner


@dataclass
class EarlyTreeStep:
    size: int  # the captured batch size it replays
    index: dict[int, int]  # req_id -> its row in this step's trees (and the next ones)
    starts: list[int]  # per request: its root's position this step
    tree: DraftTree | None = None  # the next step's trees, as the graph wrote them


class EarlyTree(EarlyPath):
    """The tree runner's early path: ``plan`` (before the verify's acceptance), ``launch``
    (after the verify: the argmax into the graph's input, its host copy issued, the replay),
    ``finish`` (in place of the late propose)."""

    runner: "TreeModelRunner"
    takes_logprobs = True  # (computed by the tree runner before the replay)

    @property
    def graph(self) -> "EarlyTreeGraphs | None":
        return super().graph

    def plan(self, reqs: list[Request], *_: object) -> None:
        """A tree engine's chain-path step (a prefill, or nothing to verify): it proposes late."""
        return self._late("not_tree")

    def plan_tree(self, reqs: list[Request], in_tree: list[bool], starts: list[int]
                  ) -> EarlyTreeStep | None:
        """Whether this tree step proposes early (None: late, the reason counted); if so, its
        blocks are grown for the worst case and the graph's inputs staged and uploaded."""
        r = self.runner
        # one-node (plain) requests in the step
        size = self._size(reqs, None if all(in_tree) else "not_all_tree")
        if isinstance(size, str):
            return self._late(size)
        d, look = r.tree.num_steps, r.tree.lookahead
        # Whatever it accepts (up to D, then the bonus), each request's tree slots must stay
        # inside max_model_len: the graph's acceptance has no cap, and it drafts for every
        # request. Near its own budget a request goes early all the same: where the host caps
        # its acceptance the request ends with this step (the graph's moves and drafts past
        # the cap land in its own scratch slots), and one left a single token takes no tree
        # next step (``finish``). (Refusing them sent 27 of 124 batch-16 tree steps late on
        # the H100, forty-second session: p50 step 1.97 ms, mean 2.29.)
        if any(q.num_tokens + d + 1 + look > r.max_model_len for q in reqs):
            return self._late("near_end")
        # The late path's grow (n_tok + lookahead) at the worst case n_tok = num_tokens + D + 1.
        if not r.allocator.grow_all([(q.req_id, q.num_tokens + d + 1 + look) for q in reqs]):
            return self._late("kv_exhausted")
        why = self.graph.stage(size, [q.req_id for q in reqs], starts)
        if why is not None:
            return self._late(why)
        return EarlyTreeStep(size=size, index={q.req_id: i for i, q in enumerate(reqs)},
                             starts=list(starts))

    def launch(self, step: EarlyTreeStep, tree_info: torch.Tensor,  # [3, n, N]
               drawn: torch.Tensor,  # [n, N] the target's token at each node (argmax or drawn)
               target_hidden: torch.Tensor | list[torch.Tensor]) -> HostCopy:
        """The graph's inputs, the step's one device-to-host copy (issued, not waited for),
        then the replay: the host reads the copy while the draft runs."""
        g = self.graph
        n = drawn.shape[0]
        acc, acc_host = g.acc_rows(n)  # [n, 4, N]
        if not g.holds(tree_info):  # trees from the late path (the early graph's are in place)
            acc[:, :3].copy_(tree_info.transpose(0, 1))
        if drawn is not g.drawn(n):  # ``draw`` writes it in place
            acc[:, 3].copy_(drawn)
        copy = HostCopy(acc, acc_host, self._event)
        with phase("propose"):
            step.tree = self.propose(step.size, n, target_hidden)
        self.stats.early += 1
        return copy

    def draw(self, logits: torch.Tensor, n: int) -> torch.Tensor:  # [n * N, V] -> [n, N]
        """The target's argmax at every node, written straight into the graph's input."""
        out = self.graph.drawn(n)  # [n, N], strided: the reduction writes it in place
        torch.argmax(logits.view(n, out.shape[1], -1), dim=-1, out=out)
        return out

    def propose(self, size: int, n: int, target_hidden: torch.Tensor | list[torch.Tensor]
                ) -> DraftTree:
        """The replay (its own method so the benchmark can time it as the step's propose)."""
        return DraftTree(*self.graph.replay(size, n, target_hidden))

    def finish(self, step: EarlyTreeStep, reqs: list[Request], accepted: dict[int, int],
               draft: bool) -> None:
        """``propose`` for an early step: nothing to launch; which requests go on with the
        trees and how far their draft KV is valid (as the late path sets them)."""
        r = self.runner
        r._tree, r._tree_row = step.tree, {}
        for q in reqs:
            i = step.index.get(q.req_id)
            if i is None or not r._takes_tree(q):
                continue
            q.draft_computed = step.starts[i] + accepted[q.req_id] + 1
            if draft:
                r._tree_row[q.req_id] = i
