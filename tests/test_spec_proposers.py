"""Proposers (pageflash/spec/proposer.py, ngram.py)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pageflash.spec.ngram import SCAN_PER_WIDTH, NgramProposer, NgramTreeProposer, ngram_candidates, ngram_lookup
from pageflash.spec.proposer import ExpansionProposer, MergedProposer, ProposalRequest, truncate_tree
from pageflash.spec.tree import DraftTree, ExpansionConfig


def lookup_ref(tokens: list[int], n_min: int, n_max: int, k: int) -> Optional[list[int]]:
    """Plain loops: longest n first, most recent earlier window, the k tokens after it, copying on
    into the copy itself past the end."""
    length = len(tokens)
    if k <= 0:
        return None
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):  # the window ends before the last token
            if tokens[start : start + n] == suffix:
                ext = list(tokens)
                for i in range(k):
                    ext.append(ext[start + n + i])
                return ext[length:]
    return None


def test_ngram_examples() -> None:
    # "1 2 3" occurred twice before; the most recent occurrence is followed by 9 9.
    assert ngram_lookup([1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 7, 1, 2, 3], 1, 4, 3).tolist() == [9, 9, 7]
    # The longest n wins over a more recent shorter match: "5 6" (n=2) beats "6" (n=1).
    assert ngram_lookup([5, 6, 8, 8, 6, 0, 5, 6], 1, 4, 2).tolist() == [8, 8]
    # Near the end the copy reads on into its own tokens: the period "1 2 3" continues.
    assert ngram_lookup([1, 2, 3, 1, 2], 1, 3, 5).tolist() == [3, 1, 2, 3, 1]
    # A match may overlap the suffix (runs).
    assert ngram_lookup([7, 7, 7, 7], 1, 4, 3).tolist() == [7, 7, 7]
    assert ngram_lookup([1, 2, 3, 4], 1, 4, 3) is None
    assert ngram_lookup([1, 2, 1], 2, 4, 3) is None  # only a 1-gram match, n_min = 2
    assert ngram_lookup([5], 1, 4, 3) is None
    assert ngram_lookup([1, 1], 1, 4, 0) is None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(0, 6),
)
def test_ngram_matches_reference_and_is_a_true_continuation(tokens, n_min, extra, k) -> None:
    n_max = n_min + extra
    got = ngram_lookup(tokens, n_min, n_max, k)
    ref = lookup_ref(tokens, n_min, n_max, k)
    assert (None if got is None else got.tolist()) == ref
    if got is not None:
        prop = got.tolist()
        assert len(prop) == k
        # Some n in [n_min, n_max] and an earlier window equal to the suffix are followed by prop
        # (in the text continued by prop itself).
        length = len(tokens)
        ext = tokens + prop
        assert any(
            tokens[s : s + n] == tokens[length - n :] and ext[s + n : s + n + k] == prop
            for n in range(n_min, min(n_max, length - 1) + 1)
            for s in range(0, length - n)
        )


def test_ngram_long_context_numpy_input() -> None:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 50000, size=200_000)
    toks[-4:] = toks[1000:1004]  # plant a 4-gram match
    got = ngram_lookup(toks, 1, 4, 5)
    assert got.tolist() == toks[1004:1009].tolist()


def test_ngram_proposer_respects_per_request_k() -> None:
    prop = NgramProposer(n_max=3, n_min=1, k=4)
    reqs = [
        ProposalRequest("a", [1, 2, 3, 4, 5, 6, 1, 2], 2),
        ProposalRequest("b", np.array([1, 2, 3, 4, 5, 6, 1, 2]), 10),
        ProposalRequest("c", [1, 2, 3, 1, 2], 0),
        ProposalRequest("d", [1, 2, 3], 3),
    ]
    out = prop.propose(reqs)
    assert out[0] is not None and out[0].tokens == (3, 4) and out[0].is_chain and out[0].draft_probs is None
    assert out[1] is not None and out[1].tokens == (3, 4, 5, 6)  # capped by the proposer's k
    assert out[2] is None and out[3] is None
    with pytest.raises(ValueError):
        NgramProposer(n_max=1, n_min=2)
    with pytest.raises(ValueError):
        ProposalRequest("x", [1], -1)


def _toy_draft(vocab: int = 8):
    """A draft 'model' whose next-token distribution depends on the last token of the context."""
    table = torch.softmax(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)) * 2, -1)

    def next_probs(requests: list[ProposalRequest], idx: list[int], paths: list[list[int]]) -> torch.Tensor:
        last = [(p[-1] if p else int(requests[i].token_ids[-1])) for i, p in zip(idx, paths)]
        return table[torch.tensor(last)]

    return next_probs, table


def test_expansion_proposer_builds_trees_within_k() -> None:
    fn, table = _toy_draft()
    g = torch.Generator().manual_seed(1)
    prop = ExpansionProposer("draft", fn, ExpansionConfig([2, 2]), sample=True, generator=g)
    out = prop.propose([ProposalRequest("a", [3], 6), ProposalRequest("b", [5], 3), ProposalRequest("c", [1], 0)])
    assert len(out[0]) == 6 and len(out[1]) == 3 and out[2] is None
    assert out[0].draft_probs.shape == (6, 8)
    # The first root child was drawn from the distribution after the request's last token.
    torch.testing.assert_close(out[0].draft_probs[0], table[3])
    greedy = ExpansionProposer("draft-topk", fn, ExpansionConfig([1, 1, 1]))
    t = greedy.propose([ProposalRequest("a", [3], 3)])[0]
    expect, last = [], 3
    for _ in range(3):
        last = int(table[last].argmax())
        expect.append(last)
    assert t.is_chain and list(t.tokens) == expect and t.draft_probs is None


def candidates_ref(tokens: list[int], n_min: int, n_max: int, k: int, width: int) -> list[list[int]]:
    """Plain loops: longest n first; per n the SCAN_PER_WIDTH * width most recent earlier windows,
    most recent first; the k tokens after each (copying on past the end); distinct ones, <= width."""
    length = len(tokens)
    out: list[list[int]] = []
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n:]
        starts = [s for s in range(length - n - 1, -1, -1) if tokens[s: s + n] == suffix]
        for start in starts[: SCAN_PER_WIDTH * width]:
            ext = list(tokens)
            for i in range(k):
                ext.append(ext[start + n + i])
            cont = ext[length:]
            if cont not in out:
                out.append(cont)
                if len(out) == width:
                    return out
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=60), st.integers(1, 3), st.integers(0, 3),
       st.integers(1, 6), st.integers(1, 4))
def test_ngram_candidates_match_reference(tokens, n_min, extra, k, width) -> None:
    got = [c.tolist() for c in ngram_candidates(tokens, n_min, n_min + extra, k, width)]
    assert got == candidates_ref(tokens, n_min, n_min + extra, k, width)


def test_ngram_tree_on_long_periodic_text() -> None:
    # thousands of 1-gram matches sharing one continuation, plus one recent different continuation
    tokens = [1, 2, 3, 4] * 3000 + [1, 9, 9] + [1, 2, 3, 4] * 2 + [1]
    conts = [c.tolist() for c in ngram_candidates(tokens, 1, 3, 4, 3)]
    assert conts == [[2, 3, 4, 1], [9, 9, 1, 2]]
    tree = NgramTreeProposer(n_max=3, k=8, width=2).propose([ProposalRequest("a", tokens, 8)])[0]
    assert {tuple(tree.path_tokens(j)) for j in range(len(tree)) if tree.depths[j] == 4} == {(2, 3, 4, 1), (9, 9, 1, 2)}


def test_merged_proposer_dedups_and_caps() -> None:
    fn, _ = _toy_draft()
    ngram = NgramProposer(n_max=2, k=3)
    draft = ExpansionProposer("draft", fn, ExpansionConfig([2, 1]))
    merged = MergedProposer([ngram, draft])
    assert merged.name == "ngram+draft"
    req = ProposalRequest("a", [1, 2, 3, 1, 2, 3, 1], 5)
    out = merged.propose([req])[0]
    ngram_tree = ngram.propose([req])[0]
    assert out.tokens[:3] == ngram_tree.tokens and len(out) <= 5
    paths = [tuple(out.path_tokens(j)) for j in range(len(out))]
    assert len(set(paths)) == len(paths)
    assert merged.propose([ProposalRequest("b", [4], 5)])[0] is not None  # only the draft proposes
    assert MergedProposer([ngram]).propose([ProposalRequest("b", [4], 5)]) == [None]


def test_truncate_tree() -> None:
    t = DraftTree([1, 2, 3, 4], [-1, -1, 0, 1], torch.full((4, 5), 0.2))
    u = truncate_tree(t, 2)
    assert u.tokens == (1, 2) and u.draft_probs.shape == (2, 5)
    assert truncate_tree(t, 9) is t
