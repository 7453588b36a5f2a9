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
    table = torch.randperm(16, generator=torch.Generator().manual_seed(1))[:9].int()[None]
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
        q, k, v, table, torch.tensor([prefix], dtype=torch.int32),
        torch.tensor([prefix + n], dtype=torch.int32), anc,
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
from compiled_spec.spec.tree import (  # noqa: E402
    TreeConfig, accept_paths, accept_walk, ancestor_mask, compact_kv, select_nodes)


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


def _select_by_stable_sorts(scores, depth, n):
    """The rule written as two stable sorts (score descending, ties by depth, then id)."""
    by_depth = torch.argsort(depth, dim=1, stable=True)
    s_sorted = torch.gather(scores, 1, by_depth)
    return torch.gather(by_depth, 1, torch.argsort(-s_sorted, dim=1, stable=True))[:, :n]


@pytest.mark.parametrize("rank_max", [1024, 0])  # ranks by pairs; the top-k + sort path
def test_select_nodes_key_ranks_exactly_as_the_stable_sorts(monkeypatch, rank_max):
    """Selection by the packed int64 keys (pairwise ranks up to RANK_SELECT_MAX candidates,
    a top-k above) picks the same set as the two stable sorts, on scores full of ties (few
    distinct values, zeros of both signs, -inf) and on continuous ones; returned by depth,
    then candidate id."""
    import compiled_spec.spec.tree as tree_mod

    monkeypatch.setattr(tree_mod, "RANK_SELECT_MAX", rank_max)
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        b, c = 3, int(torch.randint(2, 300, (1,), generator=g))
        n = int(torch.randint(1, c + 1, (1,), generator=g))
        depth = torch.randint(1, 9, (b, c), generator=g)
        if trial % 2:
            levels = torch.tensor([0.0, -0.0, -0.5, -1.25, -3.0, float("-inf")])
            scores = levels[torch.randint(0, len(levels), (b, c), generator=g)]
        else:
            scores = -torch.rand(b, c, generator=g) * 20
        parent = torch.full((b, c), -1)
        top, _, d = select_nodes(scores, depth, parent, n)
        want = _select_by_stable_sorts(scores, depth, n)
        assert [sorted(r) for r in top.tolist()] == [sorted(r) for r in want.tolist()], trial
        keys = d * (c + 1) + top  # verification order: depth, then id
        assert torch.equal(keys, keys.sort(dim=1).values)
    with pytest.raises(ValueError, match="65536 candidates"):
        TreeConfig(topk=64, num_steps=20, num_draft_tokens=8)


def test_select_nodes_ranks_equal_the_top_k_path(monkeypatch):
    """Both selection paths give the same chosen ids, parents (tree indices) and depths, on
    random ancestor-closed candidate sets (children score at most their parent), eager and
    compiled."""
    import compiled_spec.spec.tree as tree_mod

    g = torch.Generator().manual_seed(1)
    b, k, steps = 4, 4, 4
    scores = [-torch.rand(b, k, generator=g)]
    depth, parent = [torch.ones(b, k, dtype=torch.long)], [torch.full((b, k), -1)]
    for s in range(1, steps):  # k^2 children of the previous level's k candidates
        prev = torch.randint(0, k, (b, k * k), generator=g) + sum(x.shape[1] for x in scores[:-1])
        par_score = torch.gather(torch.cat(scores, 1), 1, prev)
        scores.append(par_score - torch.rand(b, k * k, generator=g))
        depth.append(torch.full((b, k * k), s + 1))
        parent.append(prev)
    sc, dp, pa = torch.cat(scores, 1), torch.cat(depth, 1), torch.cat(parent, 1)
    ranked = select_nodes(sc, dp, pa, 15)
    compiled = torch.compile(select_nodes, dynamic=False)(sc, dp, pa, 15)
    monkeypatch.setattr(tree_mod, "RANK_SELECT_MAX", 0)
    by_topk = select_nodes(sc, dp, pa, 15)
    for x, y, z in zip(ranked, by_topk, compiled):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_ancestor_mask_equals_walking_each_node_to_the_root():
    """Random trees (parents precede children): the level-by-level mask, with the tree's depth
    as the bound or none, is exactly each node's walk to the root; a bound below the depth
    misses the deepest ancestors."""
    g = torch.Generator().manual_seed(0)
    for b, n in ((1, 2), (3, 16), (4, 32)):
        parents = torch.full((b, n), -1, dtype=torch.int64)
        depth = torch.zeros(b, n, dtype=torch.int64)
        for i in range(1, n):
            parents[:, i] = torch.randint(0, i, (b,), generator=g)
            depth[:, i] = depth.gather(1, parents[:, i:i + 1])[:, 0] + 1
        want = torch.zeros(b, n, n, dtype=torch.bool)
        for r in range(b):
            for i in range(n):
                j = i
                while j >= 0:
                    want[r, i, j] = True
                    j = int(parents[r, j])
        deepest = int(depth.max())
        assert torch.equal(ancestor_mask(parents), want)
        assert torch.equal(ancestor_mask(parents, deepest), want)
        if deepest > 1:
            assert not torch.equal(ancestor_mask(parents, deepest - 1), want)


def _walk_accept(tokens, parents, top, max_depth, cap=None):
    """Reference: the walk from the root, one level at a time (the definition)."""
    path, n_acc, bonus = [], [], []
    for b in range(tokens.shape[0]):
        cur, p = 0, []
        while len(p) < max_depth and (cap is None or len(p) < int(cap[b])):
            kids = [j for j in range(1, tokens.shape[1]) if int(parents[b, j]) == cur
                    and int(tokens[b, j]) == int(top[b, cur])]
            if not kids:
                break
            cur = kids[0]
            p.append(cur)
        path.append(p + [-1] * (max_depth - len(p)))
        n_acc.append(len(p))
        bonus.append(int(top[b, cur]))
    return path, n_acc, bonus


def _accept(tokens, parents, top, depth, steps, cap=None):
    path, n, bonus = accept_paths(tokens.numpy(), parents.numpy(), top.numpy(), depth.numpy(),
                                  steps, None if cap is None else cap.numpy())
    return path.tolist(), n.tolist(), bonus.tolist()


def test_accept_paths_follows_the_drawn_tokens():
    #        root(0)
    #       /      \\
    #   a=5 (1)   b=7 (2)
    #     |          |
    #   c=9 (3)   d=4 (4)
    tokens = torch.tensor([[0, 5, 7, 9, 4], [0, 5, 7, 9, 4]])
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 0, 1, 2]])
    depth = torch.tensor([[0, 1, 1, 2, 2]] * 2)
    top = torch.tensor([[7, 1, 4, 2, 8],  # root->7 (node 2), node 2 ->4 (node 4), node 4 -> 8
                        [3, 1, 1, 1, 1]])  # nothing matches at the root
    assert _accept(tokens, parents, top, depth, 3) == ([[2, 4, -1], [-1, -1, -1]], [2, 0], [8, 3])
    # The request's budget caps the path (one draft left: node 2, bonus = the token drawn there).
    assert _accept(tokens, parents, top, depth, 3, torch.tensor([1, 5])) == (
        [[2, -1, -1], [-1, -1, -1]], [1, 0], [4, 3])


@pytest.mark.parametrize("seed", range(6))
def test_accept_paths_equals_the_walk_on_random_trees(seed):
    """The host acceptance == walking the tree level by level, on random trees with distinct
    sibling tokens, drawn tokens that often follow a branch, and random budgets."""
    g = torch.Generator().manual_seed(seed)
    b, n, vocab, steps = 16, 12, 6, 4
    parents = torch.full((b, n), -1)
    depth = torch.zeros(b, n, dtype=torch.int64)
    tokens = torch.zeros(b, n, dtype=torch.int64)
    for r in range(b):
        used: dict[int, set[int]] = {}
        for j in range(1, n):
            while True:  # a parent above the depth limit, children with distinct tokens
                p = int(torch.randint(0, j, (1,), generator=g))
                if int(depth[r, p]) < steps and len(used.get(p, ())) < vocab:
                    break
            t = int(torch.randint(0, vocab, (1,), generator=g))
            while t in used.setdefault(p, set()):
                t = (t + 1) % vocab
            used[p].add(t)
            parents[r, j], depth[r, j], tokens[r, j] = p, depth[r, p] + 1, t
    top = torch.randint(0, vocab, (b, n), generator=g)
    for r in range(b):  # mostly the drawn token is one of the node's children
        for j in range(n):
            kids = (parents[r] == j).nonzero().flatten()
            if len(kids) and float(torch.rand(1, generator=g)) < 0.8:
                top[r, j] = tokens[r, kids[int(torch.randint(0, len(kids), (1,), generator=g))]]
    cap = torch.randint(0, steps + 1, (b,), generator=g)
    for c in (None, cap):
        ref = _walk_accept(tokens, parents, top, steps, c)
        assert _accept(tokens, parents, top, depth, steps, c) == ref  # numpy (b > 2)
        walked = accept_walk(tokens.numpy(), parents.numpy(), top.numpy(), steps,
                             None if c is None else c.numpy())
        assert tuple(x.tolist() for x in walked) == ref  # the small-batch walk
        if c is None:
            assert max(ref[1]) >= 3  # the trees were deep enough to test paths


def test_compact_kv_moves_the_slots_in_every_layer():
    page, layers = 4, 3
    base = torch.arange(16 * page, dtype=torch.float32).view(16, page, 1, 1)
    caches = [tuple(base * (2 * i + j + 1) for j in range(2)) for i in range(layers)]
    before = [c.view(-1).clone() for pair in caches for c in pair]
    src, dst = [21, 23, 9], [20, 21, 8]  # 23 -> 21 while 21 -> 20: sources read first
    compact_kv(caches, src, dst)
    after = [c.view(-1) for pair in caches for c in pair]
    for b_, a_ in zip(before, after):  # every layer's keys and values
        for s_, d_ in zip(src, dst):
            assert a_[d_] == b_[s_]
        untouched = [i for i in range(16 * page) if i not in dst]
        assert torch.equal(a_[untouched], b_[untouched])
    snapshot = [c.clone() for c in after]
    compact_kv(caches, [], [])  # nothing accepted off its place: nothing to do
    assert all(torch.equal(a_, s_) for a_, s_ in zip(after, snapshot))
