"""LoRA shrink: each token's input times its adapter's A, scaled (the first half of a LoRA delta).

For x [T, K], a [S, R, K] (slot l's A matrices stacked, R = n slices x rank: slice i's A in rows
i*rank..(i+1)*rank; slot 0 = no adapter), scale float32 [S, n] (each slot's scaling per slice), and
the step's tokens grouped by slot (``order`` [T]: token indices sorted by slot; ``counts`` /
``starts`` int32 [S]: how many tokens each slot has and where its run begins in ``order``):

    p[k, t, c] = scale[l, c // rank] * x[t, K_k] @ a[l, c, K_k]   for each token t of slot l >= 1

(float32 [split_k, T, R]: K split into split_k ranges K_k whose partial products lora_expand sums;
rows of tokens without an adapter are not written). The grid is (m-blocks of T x column blocks of
R, split_k, S): a program takes up to BLOCK_M tokens of one slot's run and returns at once when the
run is shorter, so launch shapes depend only on T, R, K and S, never on which tokens have which
adapter (no host sync: CUDA-graph capturable). Why split K: a decode step has a few tokens per
adapter and R is small, so without it one program would walk all of K alone.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pageflash.kernels.host_math import cdiv, next_pow2
from pageflash.kernels.launch import fast_launch
from pageflash.lora.layers import lora_shrink_ref  # the reference: plain PyTorch (runs without Triton)

__all__ = ["DECODE_TOKENS", "lora_shrink", "lora_shrink_ref", "shrink_config"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def slot_rows(Order, Starts, slot, pid_m, count, BLOCK_M: tl.constexpr):
    """(rows int64 [BLOCK_M], mask): the token indices of row block pid_m of slot's run in Order (also
    lora_expand's)."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    rows = tl.load(Order + tl.load(Starts + slot) + offs_m, mask=m_mask, other=0).to(tl.int64)
    return rows, m_mask


@triton.jit
def _lora_shrink_kernel(
    X, A, Scale, Order, Counts, Starts, P,
    K, R, RANK, K_PER_SPLIT,
    stride_xt, stride_as, stride_ar, stride_ss, stride_pk, stride_pt,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    slot = tl.program_id(2)
    if slot == 0:  # slot 0: tokens without an adapter
        return
    count = tl.load(Counts + slot)
    num_n = tl.cdiv(R, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    if pid_m * BLOCK_M >= count:
        return
    pid_k = tl.program_id(1)
    rows, m_mask = slot_rows(Order, Starts, slot, pid_m, count, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < R
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = A + slot.to(tl.int64) * stride_as + offs_n[None, :].to(tl.int64) * stride_ar  # [1, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < k_hi
        x = tl.load(X + rows[:, None] * stride_xt + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_base + ks[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        acc = tl.dot(x, a, acc, input_precision=PREC)
    acc = acc * tl.load(Scale + slot * stride_ss + offs_n // RANK, mask=n_mask, other=0.0)[None, :]
    p_ptrs = P + pid_k * stride_pk + rows[:, None] * stride_pt + offs_n[None, :]
    tl.store(p_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


_lora_shrink_kernel = fast_launch(_lora_shrink_kernel)  # host launches via the cached CompiledKernel


# Decode-sized steps (T <= DECODE_TOKENS): the winners of scripts/lora_tiles_probe.py --pipeline on an
# H200 at llama-3-8b's projections, rank 16, each shrink beside its base GEMM on a side stream and the
# expand after both, as the decode graphs run them (docs/BENCHMARKS.md run 65). The expand is on the
# critical path and sums the shrink's split_k partials, so the split is kept small: 4 up to 32 tokens,
# 8 above (1-2 leave the shrink too few programs; 16-32 slow the expand).
DECODE_TOKENS = 256


def shrink_config(num_tokens: int, rank: int, k: int) -> dict:
    """Tiles and the K split by shapes the host knows (T, R = slices x rank, K), never by the routing
    of tokens to adapters. Decode-sized T: the probe's tiles above. Larger T (prefill chunks): row
    tiles grow with T; K is split when the tiles would leave few programs per adapter, into ranges of
    at least 512."""
    if num_tokens <= DECODE_TOKENS:
        return dict(BLOCK_M=16 if num_tokens <= 64 else 64,
                    BLOCK_N=min(64, max(16, next_pow2(rank))) if num_tokens <= 16 else 16, BLOCK_K=128,
                    split_k=max(1, min(4 if num_tokens <= 32 else 8, k // 128)), num_warps=4, num_stages=3)
    block_m = 64
    block_n = min(64, max(16, next_pow2(rank)))
    tiles = cdiv(num_tokens, block_m) * cdiv(rank, block_n)
    split_k = 1 if tiles >= 32 else max(1, min(16, k // 512, 32 // tiles))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, split_k=split_k)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                starts: torch.Tensor, config: Optional[dict] = None) -> torch.Tensor:
    """p float32 [split_k, T, R] (module docstring); rows of tokens without an adapter unwritten.
    x [T, K] and a [S, R, K] of one dtype (float16 / bfloat16 / float32), rows contiguous; scale
    float32 [S, n slices] (R = n x rank); order int64 [T] (a permutation of 0..T-1, grouped by slot);
    counts / starts int32 [S] (lora.layers.SlotGroups)."""
    t, k = x.shape
    s, r, ka = a.shape
    assert ka == k, f"lora_shrink: x has K={k}, a has K={ka}"
    assert x.dtype == a.dtype and x.dtype in _DTYPES, f"lora_shrink: dtypes {x.dtype} / {a.dtype}"
    assert x.stride(1) == 1 and a.stride(2) == 1, "lora_shrink: rows of x and a must be contiguous"
    assert scale.dim() == 2 and scale.shape[0] == s and r % scale.shape[1] == 0 and scale.dtype == torch.float32, \
        f"lora_shrink: scale must be float32 [S, slices], got {scale.dtype} {tuple(scale.shape)} for R={r}"
    assert counts.shape == (s,) and starts.shape == (s,) and order.shape == (t,), "lora_shrink: metadata shapes"
    cfg = dict(config or shrink_config(t, r, k))
    split_k = cfg.pop("split_k")
    cfg.setdefault("num_warps", 4)
    per_split = cdiv(cdiv(k, split_k), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    split_k = cdiv(k, per_split)  # (no empty ranges)
    p = torch.empty(split_k, t, r, dtype=torch.float32, device=x.device)
    if t == 0:
        return p
    grid = (cdiv(t, cfg["BLOCK_M"]) * cdiv(r, cfg["BLOCK_N"]), split_k, s)
    _lora_shrink_kernel[grid](
        x, a, scale, order, counts, starts, p, k, r, r // scale.shape[1], per_split,
        x.stride(0), a.stride(0), a.stride(1), scale.stride(0), p.stride(0), p.stride(1),
        PREC="ieee" if x.dtype == torch.float32 else "tf32", **cfg,
    )
    return p
