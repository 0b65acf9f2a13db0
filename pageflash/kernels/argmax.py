"""Row argmax of logits in two short launches, graph-safe: the greedy token of a decode step.

x.argmax(-1) over a 128k vocabulary at batch 1 is one long reduction that uses a sliver of the GPU;
the engine's eager path (``engine.sampler.argmax_rows``) splits it into five PyTorch kernels. Here
each row is cut into CHUNKS contiguous chunks: ``_argmax_chunks`` (grid CHUNKS x B) writes each
chunk's best value and index, and ``_argmax_final`` (grid B) picks the best chunk. Semantics are
``torch.argmax``'s: the first index of the largest value, NaN counting as larger than everything (the
first NaN wins), -inf rows give index 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pageflash.kernels.host_math import cdiv, next_pow2
from pageflash.kernels.launch import fast_launch

__all__ = ["argmax", "argmax_ref"]

CHUNKS = 64


@triton.jit
def _best(v, i, BIG: tl.constexpr):
    """(value, index) of the first NaN if any, else of the first maximum, over 1-D v / i."""
    nan = v != v
    first_nan = tl.min(tl.where(nan, i, BIG), 0)
    m = tl.max(tl.where(nan, float("-inf"), v), 0)
    first_max = tl.min(tl.where(v == m, i, BIG), 0)
    has_nan = first_nan < BIG
    return tl.where(has_nan, float("nan"), m), tl.where(has_nan, first_nan, first_max)


@triton.jit(do_not_specialize=["V", "CHUNK", "stride_x"])
def _argmax_chunks(X, PV, PI, V, CHUNK, stride_x, NCH: tl.constexpr, BLOCK: tl.constexpr, BIG: tl.constexpr):
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    best_v = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = tl.full([BLOCK], BIG, dtype=tl.int32)
    for start in range(lo, hi, BLOCK):
        idx = start + offs
        v = tl.load(X + b * stride_x + idx, mask=idx < hi, other=float("-inf")).to(tl.float32)
        # per lane: keep the earlier index unless the new value is larger (NaN beats any number,
        # a lane's first NaN is kept)
        nan_new = v != v
        nan_old = best_v != best_v
        take = (nan_new & ~nan_old) | (~nan_old & (v > best_v)) | ((best_i == BIG) & (idx < hi))
        best_v = tl.where(take, v, best_v)
        best_i = tl.where(take, idx, best_i)
    pv, pi = _best(best_v, best_i, BIG)
    tl.store(PV + b * NCH + c, pv)
    tl.store(PI + b * NCH + c, tl.where(pi == BIG, lo, pi))  # an all -inf chunk: its first index


_argmax_chunks = fast_launch(_argmax_chunks)  # host launches via the cached CompiledKernel


@triton.jit
def _argmax_final(PV, PI, OUT, NCH: tl.constexpr, BIG: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, NCH)
    v = tl.load(PV + b * NCH + offs)
    i = tl.load(PI + b * NCH + offs)
    # chunks are in index order, so the smallest index among the best chunks is the first occurrence;
    # an all -inf row: every chunk ties at -inf and the first index, 0, wins
    _, best = _best(v, i, BIG)
    tl.store(OUT + b, best.to(tl.int64))


_argmax_final = fast_launch(_argmax_final)  # host launches via the cached CompiledKernel


def argmax(x: torch.Tensor, out: torch.Tensor | None = None, block: int = 512) -> torch.Tensor:
    """x.argmax(-1) for x [B, V] (float16/bfloat16/float32, V contiguous, V < 2**31): int64 [B]. No
    host synchronisation (CUDA-graph safe)."""
    if x.dim() != 2:
        raise ValueError(f"argmax: expected [B, V] logits, got shape {tuple(x.shape)}")
    b, v = x.shape
    if v == 0:
        raise ValueError("argmax: empty rows (V = 0)")
    if v >= 2**31 - 1:
        raise ValueError(f"argmax: V = {v} does not fit int32 indices")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"argmax: float16/bfloat16/float32 logits expected, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("argmax: rows must be contiguous")
    if out is None:
        out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    nch = min(CHUNKS, next_pow2(cdiv(v, block)))
    chunk = cdiv(cdiv(v, nch), block) * block
    pv = torch.empty(b, nch, dtype=torch.float32, device=x.device)
    pi = torch.empty(b, nch, dtype=torch.int32, device=x.device)
    big = 2**31 - 1
    _argmax_chunks[(nch, b)](x, pv, pi, v, chunk, x.stride(0), NCH=nch, BLOCK=block, BIG=big, num_warps=4)
    _argmax_final[(b,)](pv, pi, out, NCH=nch, BIG=big, num_warps=1)
    return out


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)
