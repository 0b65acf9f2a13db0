"""DraftTree, tree attention inputs, expansion and merging (pageflash/spec/tree.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pageflash.spec.tree import (
    DraftTree,
    ExpansionConfig,
    build_tree,
    build_trees,
    chain,
    flat_tree_mask,
    kv_compaction,
    merge_trees,
    positions,
    tree_attention_mask,
    tree_from_level_candidates,
)


@st.composite
def trees(draw, max_nodes: int = 12, vocab: int = 5) -> DraftTree:
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, j - 1)) for j in range(n)]
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    return DraftTree(tokens, parents)


def ancestors_or_self(tree: DraftTree, j: int) -> set[int]:
    out = {j}
    while tree.parents[j] >= 0:
        j = tree.parents[j]
        out.add(j)
    return out


@settings(max_examples=60, deadline=None)
@given(trees())
def test_mask_matches_ancestor_brute_force(tree: DraftTree) -> None:
    n = len(tree)
    m = tree_attention_mask(tree)
    assert m.dtype == torch.bool and m.shape == (n + 1, n + 1)
    assert bool(m[:, 0].all()), "every query sees the root"
    assert not bool(m[0, 1:].any()), "the root sees no draft node"
    for j in range(n):
        anc = ancestors_or_self(tree, j)
        for i in range(n):
            assert bool(m[1 + j, 1 + i]) == (i in anc), (j, i)


@settings(max_examples=60, deadline=None)
@given(trees(), st.integers(0, 1000))
def test_positions_are_base_plus_depth(tree: DraftTree, base: int) -> None:
    pos = positions(tree, base)
    assert pos.dtype == torch.long
    assert pos[0] == base
    for j in range(len(tree)):
        assert pos[1 + j] == base + len(ancestors_or_self(tree, j))
        assert tree.path_to(j)[-1] == j and len(tree.path_to(j)) == tree.depths[j]


def test_chain_is_causal() -> None:
    t = chain([4, 5, 6])
    assert t.parents == (-1, 0, 1) and t.is_chain and t.depths == (1, 2, 3)
    assert torch.equal(tree_attention_mask(t), torch.ones(4, 4, dtype=torch.bool).tril())
    assert positions(t, 7).tolist() == [7, 8, 9, 10]
    assert t.query_tokens(3) == [3, 4, 5, 6]


def test_children_and_paths() -> None:
    t = DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 0, 2])
    assert t.children(-1) == (0, 1) and t.children(0) == (2, 3) and t.children(4) == ()
    assert t.path_to(4) == [0, 2, 4] and t.path_tokens(4) == [10, 12, 14]
    assert not t.is_chain and t.max_depth == 3 and t.num_query_tokens == 6


@pytest.mark.parametrize(
    "tokens, parents, probs",
    [([1, 2], [-1], None), ([1, 2], [-1, 1], None), ([-1], [-1], None), ([1, 2], [-1, 0], torch.zeros(3, 4))],
)
def test_invalid_trees_raise(tokens, parents, probs) -> None:
    with pytest.raises(ValueError):
        DraftTree(tokens, parents, probs)


def test_flat_tree_mask_mixes_causal_and_tree_sequences() -> None:
    t = DraftTree([1, 2, 3], [-1, -1, 0])
    out = flat_tree_mask([None, tree_attention_mask(t), None], [3, 4, 1])
    assert out.shape == (8, 4)
    assert torch.equal(out[0:3, :3], torch.ones(3, 3, dtype=torch.bool).tril())
    assert not out[0:3, 3].any()
    assert torch.equal(out[3:7], tree_attention_mask(t))
    assert out[7].tolist() == [True, False, False, False]


@settings(max_examples=60, deadline=None)
@given(trees(), st.data())
def test_kv_compaction_makes_path_contiguous(tree: DraftTree, data) -> None:
    # Any root-to-node path; apply the moves as one gather-then-scatter, like a per-layer KV copy.
    node = data.draw(st.integers(-1, len(tree) - 1))
    path = tree.path_to(node)
    src, dst = kv_compaction(path)
    slots = torch.arange(1 + len(tree)) * 100  # a stand-in "KV" per query row
    slots[torch.tensor(dst, dtype=torch.long)] = slots[torch.tensor(src, dtype=torch.long)]
    assert slots[: 1 + len(path)].tolist() == [0, *(100 * (1 + j) for j in path)]
    assert all(s != d for s, d in zip(src, dst))


def test_expansion_config() -> None:
    c = ExpansionConfig([2, 2, 1])
    assert c.num_nodes == 2 + 4 + 4 and c.depth == 3
    assert ExpansionConfig([1] * 5).num_nodes == 5
    for bad in ([], [2, 0]):
        with pytest.raises(ValueError):
            ExpansionConfig(bad)


def test_tree_from_level_candidates() -> None:
    t = tree_from_level_candidates([[7, 8, 9], [1, 2], [5]], ExpansionConfig([2, 2, 1]))
    assert len(t) == 10 and t.draft_probs is None
    assert [t.path_tokens(j) for j in range(len(t)) if t.depths[j] == 3] == [
        [7, 1, 5], [7, 2, 5], [8, 1, 5], [8, 2, 5]
    ]


def _table_next_probs(vocab: int, seed: int):
    """A toy draft 'model': a fixed random distribution per path (with some zero entries)."""
    cache: dict[tuple[int, ...], torch.Tensor] = {}

    def fn(paths: list[list[int]]) -> torch.Tensor:
        rows = []
        for p in paths:
            key = tuple(p)
            if key not in cache:
                g = torch.Generator().manual_seed(seed * 1000003 + hash(key) % 1000003)
                w = torch.rand(vocab, generator=g)
                w[torch.rand(vocab, generator=g) < 0.3] = 0
                w[0] += 1e-3  # never an all-zero row
                cache[key] = w / w.sum()
            rows.append(cache[key])
        return torch.stack(rows)

    return fn


def test_build_tree_topk_follows_the_distribution() -> None:
    fn = _table_next_probs(8, 0)
    t = build_tree(fn, ExpansionConfig([3, 2]))
    assert t.draft_probs is None
    for parent in [-1, *range(len(t))]:
        kids = t.children(parent)
        if not kids:
            continue
        q = fn([t.path_tokens(parent) if parent >= 0 else []])[0]
        expect = [x for x in torch.topk(q, len(kids)).indices.tolist()]
        assert [t.tokens[c] for c in kids] == expect
    assert all(d <= 2 for d in t.depths)


def test_build_trees_sampled_records_conditional_q() -> None:
    fn = _table_next_probs(6, 1)
    g = torch.Generator().manual_seed(0)
    ts = build_trees(lambda _r, paths: fn(paths), 3, ExpansionConfig([3, 2, 1]), sample=True, generator=g)
    for t in ts:
        assert t.draft_probs is not None and t.draft_probs.shape == (len(t), 6)
        for parent in [-1, *range(len(t))]:
            kids = t.children(parent)
            seen: list[int] = []
            q = fn([t.path_tokens(parent) if parent >= 0 else []])[0]
            for c in kids:
                tok = t.tokens[c]
                assert tok not in seen, "siblings are drawn without replacement"
                expect = q.clone()
                expect[seen] = 0
                torch.testing.assert_close(t.draft_probs[c], expect / expect.sum())
                assert t.draft_probs[c, tok] > 0
                seen.append(tok)


@settings(max_examples=60, deadline=None)
@given(st.lists(trees(max_nodes=8, vocab=3), min_size=1, max_size=4))
def test_merge_trees_is_the_union_of_token_paths(ts: list[DraftTree]) -> None:
    m = merge_trees(ts)
    paths = {tuple(m.path_tokens(j)) for j in range(len(m))}
    assert len(paths) == len(m), "no two nodes share a token path"
    assert paths == {tuple(t.path_tokens(j)) for t in ts for j in range(len(t))}
    # The first tree's nodes come first, in order (its root-level siblings keep their order).
    first_unique = list(dict.fromkeys(tuple(ts[0].path_tokens(j)) for j in range(len(ts[0]))))
    assert [tuple(m.path_tokens(j)) for j in range(len(first_unique))] == first_unique
    assert len(merge_trees(ts, max_nodes=3)) == min(3, len(m))


def test_merge_trees_keeps_first_q_and_fills_one_hot() -> None:
    qa = torch.softmax(torch.randn(2, 5), -1)
    a = DraftTree([1, 2], [-1, 0], qa)
    b = DraftTree([1, 3, 4], [-1, 0, -1])  # deterministic; shares the node "1"
    m = merge_trees([a, b])
    assert m.tokens == (1, 2, 3, 4) and m.parents == (-1, 0, 0, -1)
    torch.testing.assert_close(m.draft_probs[:2], qa)
    assert m.draft_probs[2].tolist() == [0, 0, 0, 1, 0] and m.draft_probs[3].tolist() == [0, 0, 0, 0, 1]
    assert merge_trees([b, b]).draft_probs is None
