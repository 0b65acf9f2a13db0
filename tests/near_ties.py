"""Greedy outputs of two bf16 runs that differ only in rounding (CUDA graphs planned for the longest
context against eager steps planned for each step's: other attention splits, other fp32 sums) may part
where two tokens are nearly tied. ``assert_parts_only_at_near_ties`` lets them part there, and only there."""

from __future__ import annotations

from typing import Optional, Sequence


def assert_parts_only_at_near_ties(a: Sequence[list[int]], b: Sequence[list[int]], b_logprobs: Sequence[list[dict]],
                                   max_parted: int, tol: float = 0.15,
                                   labels: Optional[Sequence] = None) -> int:
    """Rows of token ids a and b (b's run asked for logprobs, b_logprobs its per-position dicts) are equal,
    or first differ at a position where a's token is among b's top logprobs within tol nats of b's own
    token; at most max_parted rows part. Returns how many parted."""
    assert len(a) == len(b), (len(a), len(b))
    parted = 0
    for i, (x, y) in enumerate(zip(a, b)):
        if x == y:
            continue
        parted += 1
        j = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        assert j < min(len(x), len(y)), f"row {i}: one run stopped early ({len(x)} vs {len(y)} tokens)"
        top = b_logprobs[i][j]
        name = f"row {i}" + (f" ({labels[i]})" if labels is not None else "")
        print(f"{name} parts at token {j}: {y[j]} {top[y[j]].logprob:.4f} against "
              f"{x[j]} {top[x[j]].logprob if x[j] in top else None}")
        assert x[j] in top and abs(top[y[j]].logprob - top[x[j]].logprob) < tol, (i, j, top)
    assert parted <= max_parted, f"{parted} of {len(a)} rows part"
    return parted
