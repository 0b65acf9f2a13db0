"""Verification (pageflash/spec/verify.py): greedy against brute force, stochastic for losslessness.

Losslessness tests: a toy target P(. | context) and toy draft Q(. | context) over a small vocab
(random, with some zero entries so that residuals and zero-probability tokens are exercised). Many
seeded trials of one verify step each; the emitted tokens, completed with exact samples from P where
the step emitted fewer than two, must follow P. Checked with a chi-square test at a false-alarm rate
of 1e-3 per test; all seeds are fixed, so each test is deterministic (it either always passes or
always fails). ``test_chi_square_harness_has_power`` shows the same harness rejects a subtly wrong
verifier (drafts drawn from a different q than the one claimed).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pageflash.spec.tree import DraftTree, ExpansionConfig, build_trees, chain, merge_trees
from pageflash.spec.verify import (
    greedy_match,
    verify_chains,
    verify_greedy_chain,
    verify_stochastic_chain,
    verify_tree_greedy,
    verify_tree_stochastic,
    verify_trees,
)

ALPHA = 1e-3  # chi-square false-alarm rate per test


# -- toy language models --------------------------------------------------------------------------


class ToyLM:
    """Next-token distributions for every context of length <= max_len over a vocab of size V."""

    def __init__(self, vocab: int, max_len: int, seed: int, zero_frac: float = 0.25) -> None:
        self.V = vocab
        self.offsets = np.cumsum([0] + [vocab**i for i in range(max_len + 1)])
        g = torch.Generator().manual_seed(seed)
        n = int(self.offsets[-1])
        logits = torch.randn(n, vocab, generator=g) * 1.5
        drop = torch.rand(n, vocab, generator=g) < zero_frac
        drop[torch.arange(n), torch.randint(vocab, (n,), generator=g)] = False  # keep >= 1 token
        self.table = torch.softmax(logits.masked_fill(drop, float("-inf")), -1)  # [n, V]

    def index(self, ctx: np.ndarray) -> np.ndarray:
        """ctx: int [m, L] (all the same length) -> row indices [m]."""
        m, length = ctx.shape
        idx = np.zeros(m, dtype=np.int64)
        for i in range(length):
            idx = idx * self.V + ctx[:, i]
        return idx + self.offsets[length]

    def probs(self, ctx: np.ndarray) -> torch.Tensor:
        return self.table[torch.from_numpy(self.index(ctx))]

    def probs_of_paths(self, paths: list[list[int]]) -> torch.Tensor:
        idx = [int(self.offsets[len(p)]) + int(np.ravel_multi_index(p, [self.V] * len(p))) if p else 0 for p in paths]
        return self.table[torch.tensor(idx, dtype=torch.long)]


def sample(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=g).squeeze(1)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < 5 are pooled."""
    counts, probs = counts.flatten().double(), probs.flatten().double()
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "emitted a token the target gives probability 0"
    exp = probs * n
    big = exp >= 5
    obs_c, exp_c = counts[big].tolist(), exp[big].tolist()
    if exp[~big].sum() > 0:
        obs_c.append(float(counts[~big].sum()))
        exp_c.append(float(exp[~big].sum()))
    o, e = torch.tensor(obs_c), torch.tensor(exp_c)
    stat = ((o - e) ** 2 / e).sum()
    dof = len(obs_c) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), stat / 2))


def first_two(emitted: list[list[int]], target: ToyLM, g: torch.Generator) -> torch.Tensor:
    """Joint counts [V, V] of the first two tokens; a step that emitted one token is completed by
    sampling the second from the target itself (the next step's job, exact by definition)."""
    y0 = np.array([e[0] for e in emitted])
    y1 = sample(target.probs(y0[:, None]), g).numpy()
    has2 = np.array([len(e) >= 2 for e in emitted])
    y1[has2] = [e[1] for e in emitted if len(e) >= 2]
    counts = torch.zeros(target.V * target.V)
    counts.index_add_(0, torch.from_numpy(y0 * target.V + y1), torch.ones(len(y0)))
    return counts


def joint_first_two(target: ToyLM) -> torch.Tensor:
    p0 = target.probs(np.zeros((1, 0), dtype=np.int64))[0]
    p1 = target.probs(np.arange(target.V)[:, None])  # [V, V]
    return p0[:, None] * p1


# -- greedy ---------------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2), max_size=6), st.data())
def test_greedy_chain_brute_force(draft: list[int], data) -> None:
    amax = data.draw(st.lists(st.integers(0, 2), min_size=len(draft) + 1, max_size=len(draft) + 1))
    expect = []
    for i, t in enumerate(draft):
        if t != amax[i]:
            break
        expect.append(t)
    expect.append(amax[len(expect)])
    assert verify_greedy_chain(torch.tensor(draft, dtype=torch.long), torch.tensor(amax)) == expect
    # The batched path agrees: one-hot "probs" put the argmax where we want it.
    probs = torch.nn.functional.one_hot(torch.tensor(amax), 3).float()
    assert verify_chains([draft], probs, greedy=True).to_lists() == [expect]


@st.composite
def trees_with_unique_siblings(draw, max_nodes: int = 12, vocab: int = 3) -> DraftTree:
    n = draw(st.integers(0, max_nodes))
    tokens: list[int] = []
    parents: list[int] = []
    used: dict[int, set[int]] = {}
    for j in range(n):
        p = draw(st.integers(-1, len(tokens) - 1))
        t = draw(st.integers(0, vocab - 1))
        if t in used.setdefault(p, set()):
            continue
        used[p].add(t)
        parents.append(p)
        tokens.append(t)
    return DraftTree(tokens, parents)


@settings(max_examples=100, deadline=None)
@given(trees_with_unique_siblings(), st.data())
def test_greedy_tree_brute_force(tree: DraftTree, data) -> None:
    n = len(tree)
    amax = data.draw(st.lists(st.integers(0, 2), min_size=n + 1, max_size=n + 1))
    # Brute force: the nodes whose whole path agrees with the target form one path (siblings are
    # unique); the deepest of them is where the greedy walk ends.
    ok = [j for j in range(n) if all(tree.tokens[i] == amax[1 + tree.parents[i]] for i in tree.path_to(j))]
    end = max(ok, key=lambda j: tree.depths[j], default=-1)
    path = tree.path_to(end)
    res = verify_tree_greedy(tree, torch.tensor(amax))
    assert res.path == path
    assert res.tokens == [tree.tokens[j] for j in path] + [amax[1 + end]]
    probs = torch.nn.functional.one_hot(torch.tensor(amax), 3).float()
    assert verify_trees([tree], probs, greedy=True)[0] == res
    assert verify_trees([tree], probs, greedy=[True])[0] == res


@settings(max_examples=100, deadline=None)
@given(trees_with_unique_siblings(), st.lists(st.integers(0, 2), max_size=8))
def test_greedy_match_brute_force(tree: DraftTree, actual: list[int]) -> None:
    """A shadow draft's score: the deepest node whose whole path spells the start of what came."""
    ok = [j for j in range(len(tree)) if tree.depths[j] <= len(actual)
          and [tree.tokens[i] for i in tree.path_to(j)] == actual[: tree.depths[j]]]
    assert greedy_match(tree, actual) == max((tree.depths[j] for j in ok), default=0)


def test_greedy_match_examples() -> None:
    assert greedy_match(chain([5, 6, 7]), [5, 6, 7, 8]) == 3
    assert greedy_match(chain([5, 6, 7]), [5, 6]) == 2  # what is known so far
    assert greedy_match(chain([5, 6, 7]), [5, 9, 7]) == 1
    assert greedy_match(chain([5, 6, 7]), []) == 0
    tree = DraftTree([1, 2, 3, 4], [-1, -1, 1, 1])  # 1 | 2 -> {3, 4}
    assert greedy_match(tree, [2, 4]) == 2 and greedy_match(tree, [1, 4]) == 1 and greedy_match(tree, [7]) == 0


def test_greedy_chain_examples() -> None:
    assert verify_greedy_chain(torch.tensor([5, 6, 7]), torch.tensor([5, 6, 7, 8])) == [5, 6, 7, 8]
    assert verify_greedy_chain(torch.tensor([5, 6, 7]), torch.tensor([4, 6, 7, 8])) == [4]
    assert verify_greedy_chain(torch.tensor([], dtype=torch.long), torch.tensor([3])) == [3]


# -- stochastic: basic properties -----------------------------------------------------------------


def test_draft_equal_to_target_is_always_accepted() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 7, generator=g), -1)
    for _ in range(20):
        draft = sample(p[:4], g)
        out = verify_stochastic_chain(draft, p[:4], p, g)
        assert out[:4] == draft.tolist() and len(out) == 5


def test_zero_target_probability_is_never_accepted() -> None:
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5]])
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        assert verify_stochastic_chain(torch.tensor([0]), None, p, g)[0] != 0
        q = torch.tensor([[0.9, 0.05, 0.05]])
        assert verify_stochastic_chain(torch.tensor([0]), q, p, g)[0] != 0


def test_seeded_request_is_batch_independent() -> None:
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(9, 6), -1)
    q = torch.softmax(torch.randn(3, 6), -1)
    alone = verify_chains([[1, 2, 3]], p[4:8], [q], generators=[torch.Generator().manual_seed(7)]).to_lists()[0]
    for _ in range(3):
        batch = verify_chains(
            [[0, 1, 2], [1, 2, 3], []],
            torch.cat([p[:4], p[4:8], p[8:]]),
            [None, q, None],
            generators=[None, torch.Generator().manual_seed(7), None],
        ).to_lists()
        assert batch[1] == alone
    t = DraftTree([1, 2, 3], [-1, -1, 0])
    alone_t = verify_tree_stochastic(t, p[4:8], torch.Generator().manual_seed(3))
    gens = [None, torch.Generator().manual_seed(3)]
    batch_t = verify_trees([chain([4]), t], torch.cat([p[:2], p[4:8]]), generators=gens)
    assert batch_t[1] == alone_t


def test_mixed_greedy_and_random_batch() -> None:
    torch.manual_seed(1)
    p = torch.softmax(torch.randn(7, 5) * 3, -1)
    amax = p.argmax(-1).tolist()
    out = verify_chains([[amax[0], amax[1]], [0, 1, 2]], p, greedy=[True, False]).to_lists()
    assert out[0] == [amax[0], amax[1], amax[2]]
    assert 1 <= len(out[1]) <= 4


def test_shape_errors() -> None:
    p = torch.softmax(torch.randn(3, 4), -1)
    with pytest.raises(ValueError):
        verify_chains([[1, 2, 3]], p)
    with pytest.raises(ValueError):
        verify_chains([[1, 9]], p)
    with pytest.raises(ValueError):
        verify_chains([[1, 2]], p, [torch.ones(3, 4) / 4])
    with pytest.raises(ValueError):
        verify_trees([chain([1])], p)


# -- stochastic: losslessness ---------------------------------------------------------------------

V = 6
N = 20000  # trials per chain test
NT = 6000  # trials per tree test (trees cost more host work per trial)


def _chain_trials(k: int, target: ToyLM, draft: ToyLM, deterministic: bool, seed: int, claimed: ToyLM | None = None):
    """N requests, each a chain of k drafts sampled from `draft`; verify against `target`."""
    g = torch.Generator().manual_seed(seed)
    ctx = np.zeros((N, 0), dtype=np.int64)
    qs, ps = [], [target.probs(ctx)]
    for _ in range(k):
        q = draft.probs(ctx)
        x = sample(q, g).numpy()
        qs.append((claimed or draft).probs(ctx))
        ctx = np.concatenate([ctx, x[:, None]], 1)
        ps.append(target.probs(ctx))
    p_flat = torch.stack(ps, 1).reshape(N * (k + 1), V)  # request-major flat layout
    q_all = torch.stack(qs, 1) if k else torch.zeros(N, 0, V)
    drafts = torch.from_numpy(ctx)
    dprobs = None if deterministic else list(q_all.unbind(0))
    emitted = verify_chains(list(drafts.unbind(0)), p_flat, dprobs, generator=g).to_lists()
    return emitted, g


@pytest.mark.parametrize("k, deterministic", [(1, False), (3, False), (3, True), (0, False)])
def test_chain_is_lossless(k: int, deterministic: bool) -> None:
    target, draft = ToyLM(V, 4, seed=1), ToyLM(V, 4, seed=2)
    emitted, g = _chain_trials(k, target, draft, deterministic, seed=10 + k)
    assert all(1 <= len(e) <= k + 1 for e in emitted)
    assert chi2_pvalue(first_two(emitted, target, g), joint_first_two(target)) > ALPHA
    if k:
        # Speculation actually happened: some steps accepted drafts.
        assert sum(len(e) - 1 for e in emitted) > N * 0.1


def test_chi_square_harness_has_power() -> None:
    # Drafts drawn from one q but verified as if drawn from another: the output is biased, and the
    # harness must see it (otherwise a passing losslessness test would mean little).
    target, draft, claimed = ToyLM(V, 4, seed=1), ToyLM(V, 4, seed=2), ToyLM(V, 4, seed=3)
    emitted, g = _chain_trials(2, target, draft, False, seed=5, claimed=claimed)
    assert chi2_pvalue(first_two(emitted, target, g), joint_first_two(target)) < ALPHA


def _verify_trees_on(target: ToyLM, trees: list[DraftTree], g: torch.Generator) -> list[list[int]]:
    """Target rows for every tree (root, then each node's path) in the flat layout; verify."""
    p_flat = target.probs_of_paths([p for t in trees for p in [[]] + [t.path_tokens(j) for j in range(len(t))]])
    results = verify_trees(trees, p_flat, generator=g)
    for t, r in zip(trees, results):
        assert r.path == (t.path_to(r.path[-1]) if r.path else [])
    return [r.tokens for r in results]


@pytest.mark.parametrize(
    "branching, how",
    [([3, 2], "sampled"), ([2, 2, 1], "topk"), ([2, 1], "merged"), ([4], "sampled"), ([1, 1, 1], "topk")],
    ids=["sampled-3x2", "topk-2x2x1", "merged-sampled+topk", "sampled-wide", "greedy-chain-as-tree"],
)
def test_tree_is_lossless(branching: list[int], how: str) -> None:
    target, draft, other = ToyLM(V, 4, seed=1), ToyLM(V, 4, seed=2), ToyLM(V, 4, seed=3)
    g = torch.Generator().manual_seed(11)
    cfg = ExpansionConfig(branching)
    trees = build_trees(lambda _r, p: draft.probs_of_paths(p), NT, cfg, sample=how != "topk", generator=g)
    if how == "merged":
        # A sampled tree merged with another proposer's top-k tree: q rows mix real and one-hot.
        b = build_trees(lambda _r, p: other.probs_of_paths(p), NT, cfg)
        merged = [merge_trees([x, y]) for x, y in zip(trees, b)]
        assert any(len(m) > len(x) for m, x in zip(merged, trees))
        trees = merged
    emitted = _verify_trees_on(target, trees, g)
    assert chi2_pvalue(first_two(emitted, target, g), joint_first_two(target)) > ALPHA
    assert sum(len(e) - 1 for e in emitted) > len(emitted) * 0.1


def test_mixed_chain_and_tree_batch_is_lossless() -> None:
    # Deterministic chains and sampled trees in one verify_trees call (the engine's mixed batch).
    target, draft = ToyLM(V, 4, seed=4), ToyLM(V, 4, seed=5)
    g = torch.Generator().manual_seed(3)
    n = NT
    trees = build_trees(lambda _r, p: draft.probs_of_paths(p), n, ExpansionConfig([2, 1]), sample=True, generator=g)
    trees = [t if i % 2 else chain(t.path_tokens(t.children(-1)[0]) if len(t) else []) for i, t in enumerate(trees)]
    emitted = _verify_trees_on(target, trees, g)
    assert chi2_pvalue(first_two(emitted, target, g), joint_first_two(target)) > ALPHA
