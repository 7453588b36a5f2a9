"""Tree drafting building blocks: tree attention over the paged cache, EAGLE-2 node selection,
ancestor masks and greedy acceptance on trees."""
from __future__ import annotations

import pytest
import torch

import kernels.ops  # noqa: F401
from kernels.attention_ref import paged_attention_ref, paged_tree_attention_ref


def _cache(page: int, blocks: int = 16, kv_heads: int = 2, dim: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks, page, kv_heads, dim, generator=g)
    v = torch.randn(blocks, page, kv_heads, dim, generator=g)
    return k, v


@pytest.mark.parametrize("page", [1, 4, 16])
def test_chain_tree_equals_causal_attention(page):
    k, v = _cache(page)
    prefix, n = 5, 4
    table = torch.randperm(16, generator=torch.Generator().manual_seed(1))[:8].int()[None]
    q = torch.randn(n, 4, 8)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    causal = paged_attention_ref(q, k, v, table, torch.tensor([prefix + n], dtype=torch.int32),
                                 qsl, n, prefix + n, 0.3)
    chain = torch.ones(n, n, dtype=torch.bool).tril()
    tree = paged_tree_attention_ref(q, k, v, table, torch.tensor([prefix], dtype=torch.int32),
                                    chain, qsl, n, n, prefix + n, 0.3)
    torch.testing.assert_close(tree, causal)


def test_branching_tree_matches_dense_reference():
    page, prefix = 4, 6
    k, v = _cache(page, seed=2)
    parents = [-1, 0, 0, 1, 2]  # root, two children, one grandchild under each
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parents[j]
    table = torch.tensor([[3, 1, 7, 0]], dtype=torch.int32)
    q = torch.randn(n, 4, 8)
    out = torch.ops.compiled_spec.paged_tree_attention(
        q, k, v, table, torch.tensor([prefix], dtype=torch.int32), anc,
        torch.tensor([0, n], dtype=torch.int32), n, n, prefix + n, 0.5)
    flat_k, flat_v = k.reshape(-1, 2, 8), v.reshape(-1, 2, 8)
    slot = lambda p: int(table[0, p // page]) * page + p % page  # noqa: E731
    for i in range(n):
        pos = list(range(prefix)) + [prefix + j for j in range(n) if anc[i, j]]
        ks = flat_k[[slot(p) for p in pos]].repeat_interleave(2, dim=1)  # [S, 4, 8]
        vs = flat_v[[slot(p) for p in pos]].repeat_interleave(2, dim=1)
        att = torch.softmax(torch.einsum("hd,shd->hs", q[i], ks) * 0.5, dim=-1)
        torch.testing.assert_close(out[i], torch.einsum("hs,shd->hd", att, vs))


# --- selection, masks, acceptance, compaction --------------------------------------------------
from compiled_spec.spec.tree import (TreeConfig, ancestor_mask, compact_kv,  # noqa: E402
                                     greedy_accept, select_nodes)


def test_tree_config_validation():
    c = TreeConfig(topk=4, num_steps=5, num_draft_tokens=32)
    assert c.num_candidates == 4 + 4 * 16 and c.num_forwarded == 16 and c.lookahead == 32
    for bad in (dict(topk=0, num_steps=2, num_draft_tokens=4),
                dict(topk=2, num_steps=2, num_draft_tokens=1),
                dict(topk=2, num_steps=2, num_draft_tokens=8)):  # > 1 + 2 + 4
        with pytest.raises(ValueError, match="speculative_"):
            TreeConfig(**bad)


def test_select_nodes_is_ancestor_closed_and_parent_first():
    # candidates: 0,1 (depth 1), 2,3 children of 0, 4,5 children of 1 (depth 2), 6 child of 2
    scores = torch.tensor([[-0.1, -1.0, -0.1, -2.0, -1.5, -1.2, -0.3]])  # 2 ties its parent 0
    depth = torch.tensor([[1, 1, 2, 2, 2, 2, 3]])
    parent = torch.tensor([[-1, -1, 0, 0, 1, 1, 2]])
    top, par, d = select_nodes(scores, depth, parent, 4)
    assert top.tolist() == [[0, 1, 2, 6]] and d.tolist() == [[1, 1, 2, 3]]
    assert par.tolist() == [[0, 0, 1, 3]]  # tree indices: root 0, cand 0 -> 1, cand 2 -> 3
    anc = ancestor_mask(torch.cat([torch.tensor([[-1]]), par], 1))
    assert anc[0, 4].nonzero().flatten().tolist() == [0, 1, 3, 4]
    assert anc[0, 2].nonzero().flatten().tolist() == [0, 2]


def test_greedy_accept_follows_target_argmax():
    #        root(0)
    #       /      \\
    #   a=5 (1)   b=7 (2)
    #     |          |
    #   c=9 (3)   d=4 (4)
    tokens = torch.tensor([[0, 5, 7, 9, 4], [0, 5, 7, 9, 4]])
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 0, 1, 2]])
    top = torch.tensor([[7, 1, 4, 2, 8],  # root->7 (node 2), node 2 ->4 (node 4), node 4 -> 8
                        [3, 1, 1, 1, 1]])  # nothing matches at the root
    path, n, bonus = greedy_accept(tokens, parents, top, max_depth=3)
    assert path.tolist() == [[2, 4, -1], [-1, -1, -1]]
    assert n.tolist() == [2, 0] and bonus.tolist() == [8, 3]


def test_compact_kv_moves_the_path():
    page = 4
    k = torch.arange(16 * page, dtype=torch.float32).view(16, page, 1, 1).clone()
    v = -k.clone()
    table = torch.tensor([[5, 2, 9]], dtype=torch.int32)
    base = torch.tensor([3])  # root at position 3; nodes at 4.. ; path nodes 2 then 4
    slot = lambda p: int(table[0, p // page]) * page + p % page  # noqa: E731
    before = k.view(-1).clone()
    compact_kv([(k, v)], table, base, torch.tensor([[2, 4, -1]]))
    after = k.view(-1)
    assert after[slot(4)] == before[slot(5)] and after[slot(5)] == before[slot(7)]
    assert after[slot(6)] == before[slot(6)]  # past the path: untouched
    assert torch.equal(v.view(-1), -after)
