"""N-gram (prompt lookup) proposer: copy what followed the last earlier occurrence of the suffix.

No model, no probabilities: the draft is deterministic, so verification treats it as one-hot, which
keeps sampling lossless. It shines where outputs quote their inputs (summaries, code edits, RAG).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from pageflash.spec.proposer import ProposalRequest
from pageflash.spec.tree import DraftTree


def ngram_lookup(tokens: Union[Sequence[int], np.ndarray], n_min: int, n_max: int, k: int) -> Optional[np.ndarray]:
    """The up to k tokens that followed the most recent earlier match of the longest suffix n-gram.

    Tries n = n_max down to n_min: the last n tokens are matched against every earlier window (a
    match may overlap the suffix, but is never the suffix itself); among the matches of the longest
    n that has any, the most recent wins, and the tokens after it are proposed. When the match sits
    near the end, the copy reads on into the tokens it has just proposed (as an LZ77 copy with
    overlap): a text that repeats with period d keeps being drafted d tokens at a time instead of
    running out, which is what a model caught in a loop does. Returns int64 [k] or None.

    O(L) vectorized: one comparison pass finds the 1-gram matches, then each longer n only filters
    the survivors, so long contexts cost one numpy pass, not one per n.
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    if k <= 0 or length < 2 or n_max < 1:
        return None
    # End positions j (< L - 1, so something follows) of earlier windows matching the suffix.
    cand = np.flatnonzero(arr[:-1] == arr[-1])
    if cand.size == 0:
        return None
    best_n, best = 1, cand
    for m in range(1, min(n_max, length - 1)):
        c = best[best >= m]
        c = c[arr[c - m] == arr[length - 1 - m]]
        if c.size == 0:
            break
        best_n, best = m + 1, c
    if best_n < n_min:
        return None
    j = int(best[-1])  # flatnonzero is ascending: the last one is the most recent
    return _copy_from(arr, j + 1, k)


def _copy_from(arr: np.ndarray, start: int, k: int) -> np.ndarray:
    """k tokens copied from arr[start:], reading on into the copy itself past the end (periodic)."""
    if start + k <= arr.shape[0]:
        return arr[start : start + k]
    return np.resize(arr[start:], k)  # np.resize repeats the period arr[start:] cyclically


class NgramProposer:
    """Prompt-lookup decoding over prompt + output.

    n_max / n_min: longest and shortest suffix n-gram to match (n_max tried first).
    k: upper bound on the draft length; each request's num_speculative_tokens may lower it.
    """

    drafts_on_host = True  # no device work: the adaptive decoder may draft from history for free

    def __init__(self, n_max: int = 4, n_min: int = 1, k: int = 5, name: str = "ngram") -> None:
        if n_min < 1:
            raise ValueError(f"NgramProposer: n_min must be >= 1, got {n_min}")
        if n_max < n_min:
            raise ValueError(f"NgramProposer: n_max ({n_max}) must be >= n_min ({n_min})")
        if k < 1:
            raise ValueError(f"NgramProposer: k must be >= 1, got {k}")
        self.name = name
        self.n_max, self.n_min, self.k = n_max, n_min, k

    def propose(self, requests: list[ProposalRequest]) -> list[Optional[DraftTree]]:
        out: list[Optional[DraftTree]] = []
        for r in requests:
            k = min(self.k, r.num_speculative_tokens)
            toks = ngram_lookup(r.token_ids, self.n_min, self.n_max, k)
            out.append(DraftTree.chain(toks.tolist()) if toks is not None and toks.size else None)
        return out


SCAN_PER_WIDTH = 8


def ngram_candidates(
    tokens: Union[Sequence[int], np.ndarray], n_min: int, n_max: int, k: int, width: int
) -> list[np.ndarray]:
    """Up to ``width`` distinct continuations (each <= k tokens) for a merged n-gram tree.

    Matches of the longest suffix n-gram come first, most recent first; then those of shorter n.
    The first entry is what :func:`ngram_lookup` returns (continuations copy on periodically past the
    end, as there). Continuations equal to an earlier one are skipped (their tokens, not their
    positions, decide). At most ``SCAN_PER_WIDTH * width`` matches per n are looked at (the most
    recent): in repetitive text thousands of matches share one continuation, and the scan would
    otherwise cost O(matches) Python work per step.
    """
    arr = np.asarray(tokens, dtype=np.int64)
    length = arr.shape[0]
    if k <= 0 or width <= 0 or length < 2 or n_max < 1:
        return []
    cand = np.flatnonzero(arr[:-1] == arr[-1])
    levels = [cand]  # levels[n - 1]: end positions of matches of the n-gram suffix
    for m in range(1, min(n_max, length - 1)):
        c = levels[-1]
        c = c[c >= m]
        c = c[arr[c - m] == arr[length - 1 - m]]
        if c.size == 0:
            break
        levels.append(c)
    out: list[np.ndarray] = []
    seen: set[tuple[int, ...]] = set()
    for n in range(len(levels), n_min - 1, -1):
        for j in levels[n - 1][::-1][: SCAN_PER_WIDTH * width].tolist():
            cont = _copy_from(arr, j + 1, k)
            key = tuple(cont.tolist())
            if cont.size and key not in seen:
                seen.add(key)
                out.append(cont)
                if len(out) == width:
                    return out
    return out


class NgramTreeProposer:
    """Merged n-gram tree: the ``width`` best distinct continuations (longest n-gram first, most recent
    first), each up to ``k // width`` tokens, merged by token prefix (SpecInfer's merge-based tree)."""

    drafts_on_host = True

    def __init__(self, n_max: int = 4, n_min: int = 1, k: int = 10, width: int = 2, name: str = "ngram") -> None:
        if n_min < 1 or n_max < n_min or k < 1 or width < 1:
            raise ValueError(f"NgramTreeProposer: need 1 <= n_min <= n_max, k >= 1, width >= 1; got "
                             f"n_min={n_min}, n_max={n_max}, k={k}, width={width}")
        self.name = name
        self.n_max, self.n_min, self.k, self.width = n_max, n_min, k, width

    def propose(self, requests: list[ProposalRequest]) -> list[Optional[DraftTree]]:
        from pageflash.spec.tree import merge_trees

        out: list[Optional[DraftTree]] = []
        for r in requests:
            k = min(self.k, r.num_speculative_tokens)
            depth = max(1, k // self.width)
            conts = ngram_candidates(r.token_ids, self.n_min, self.n_max, depth, self.width) if k > 0 else []
            if not conts:
                out.append(None)
                continue
            tree = merge_trees([DraftTree.chain(c.tolist()) for c in conts], max_nodes=k)
            out.append(tree if len(tree) else None)
        return out
