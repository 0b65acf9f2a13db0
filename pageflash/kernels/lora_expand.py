"""LoRA expand: each token's shrunk input times its adapter's B, added into the projection's output.

For p float32 [split_k, T, n x rank] (lora_shrink's partial products, summed here), b [S, N, rank]
(slot l's B matrices; the output columns are n slices of sizes slices[0..n-1] -- q, k, v of a merged
qkv projection, gate and up of a merged gate/up one -- and slice i reads columns i*rank..(i+1)*rank
of p), and the tokens grouped by slot (order, counts, starts as in lora_shrink):

    out[t, cols of slice i] += (sum_k p[k, t, i*rank:(i+1)*rank]) @ b[l, cols of slice i]^T

for each token t of slot l >= 1 (tokens without an adapter keep their output). Why B per slot as
[N, rank] with the slices side by side rather than one block-diagonal [N, n x rank] matrix: a decode
step reads B once per adapter, and the zero blocks would be read too (2-3x the bytes).
The grid is (m-blocks of T, column tiles of every slice, S): each column tile lies in one slice, and
programs past a slot's token count return at once (static launch shapes, no host sync).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from pageflash.kernels.host_math import cdiv, next_pow2
from pageflash.kernels.launch import fast_launch
from pageflash.kernels.lora_shrink import DECODE_TOKENS, slot_rows
from pageflash.lora.layers import lora_expand_ref  # the reference: plain PyTorch (runs without Triton)

__all__ = ["lora_expand", "lora_expand_ref", "expand_config"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _lora_expand_kernel(
    P, B, Order, Counts, Starts, Out,
    N0, N1, N2, RANK, SPLIT_K,
    stride_pk, stride_pt, stride_bs, stride_bn, stride_ot,
    PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    slot = tl.program_id(2)
    if slot == 0:  # slot 0: tokens without an adapter
        return
    count = tl.load(Counts + slot)
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= count:
        return
    # which slice this column tile lies in (absent slices have size 0, so no tile maps to them)
    pid_n = tl.program_id(1)
    t0 = tl.cdiv(N0, BLOCK_N)
    t1 = tl.cdiv(N1, BLOCK_N)
    ge1 = (pid_n >= t0).to(tl.int32)
    ge2 = (pid_n >= t0 + t1).to(tl.int32)
    piece = ge1 + ge2
    tile = pid_n - ge1 * t0 - ge2 * t1
    first_col = ge1 * N0 + ge2 * N1
    width = N0 + ge1 * (N1 - N0) + ge2 * (N2 - N1)

    rows, m_mask = slot_rows(Order, Starts, slot, pid_m, count, BLOCK_M)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    cols = first_col + offs_n
    offs_r = tl.arange(0, BLOCK_R)
    b_base = B + slot.to(tl.int64) * stride_bs + cols[None, :].to(tl.int64) * stride_bn  # [1, BN]
    p_base = P + rows[:, None] * stride_pt + piece * RANK  # [BM, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, RANK, BLOCK_R):
        rs = r0 + offs_r
        r_mask = rs < RANK
        s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k in range(0, SPLIT_K):
            s += tl.load(p_base + k * stride_pk + rs[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        b = tl.load(b_base + rs[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BR, BN]
        acc = tl.dot(s.to(b.dtype), b, acc, input_precision=PREC)
    o_ptrs = Out + rows[:, None] * stride_ot + cols[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (o + acc).to(Out.dtype.element_ty), mask=mask)


_lora_expand_kernel = fast_launch(_lora_expand_kernel)  # host launches via the cached CompiledKernel


def expand_config(num_tokens: int, rank: int, n: int = 0) -> dict:
    """Tiles by shapes the host knows (T, rank, N outputs). Decode-sized T (lora_shrink.DECODE_TOKENS):
    wide column tiles and 8 warps (scripts/lora_tiles_probe.py --pipeline, H200; 256 columns from
    16384 outputs on, gate/up); larger T keeps 64-column tiles of 4 warps."""
    block_r = min(64, max(16, next_pow2(rank)))
    if num_tokens <= DECODE_TOKENS:
        return dict(BLOCK_M=16 if num_tokens <= 64 else 32, BLOCK_N=256 if n >= 16384 else 128, BLOCK_R=block_r,
                    num_warps=8, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_R=block_r)


def _check(p: torch.Tensor, b: torch.Tensor, out: torch.Tensor, slices: Sequence[int]) -> int:
    """The rank (b's last dim), after the launcher's shape checks."""
    s, n, rank = b.shape
    assert 1 <= len(slices) <= 3 and sum(slices) == n, f"lora_expand: slices {list(slices)} must sum to N={n}"
    assert p.dim() == 3 and p.shape[1:] == (out.shape[0], len(slices) * rank), \
        f"lora_expand: p {tuple(p.shape)} for {out.shape[0]} tokens, {len(slices)} slices of rank {rank}"
    assert out.shape[1] == n, f"lora_expand: out has {out.shape[1]} columns, b has {n}"
    return rank


def lora_expand(p: torch.Tensor, b: torch.Tensor, order: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor,
                out: torch.Tensor, slices: Sequence[int], config: Optional[dict] = None) -> torch.Tensor:
    """out [T, N] += each adapter token's delta, in place (module docstring); returns out. p float32
    [split_k, T, len(slices) * rank] with contiguous rows; b [S, N, rank] and out of one dtype
    (float16 / bfloat16 / float32), rows contiguous; order int64 [T]; counts / starts int32 [S]."""
    rank = _check(p, b, out, slices)
    t = out.shape[0]
    assert b.dtype == out.dtype and b.dtype in _DTYPES, f"lora_expand: dtypes {b.dtype} / {out.dtype}"
    assert p.dtype == torch.float32 and p.stride(2) == 1, "lora_expand: p must be float32, rows contiguous"
    assert b.stride(2) == 1 and out.stride(1) == 1, "lora_expand: rows of b and out must be contiguous"
    if t == 0:
        return out
    cfg = dict(config or expand_config(t, rank, out.shape[1]))
    cfg.setdefault("num_warps", 4)
    n0, n1, n2 = (list(slices) + [0, 0])[:3]
    tiles = sum(cdiv(w, cfg["BLOCK_N"]) for w in (n0, n1, n2))
    grid = (cdiv(t, cfg["BLOCK_M"]), tiles, b.shape[0])
    _lora_expand_kernel[grid](
        p, b, order, counts, starts, out, n0, n1, n2, rank, p.shape[0],
        p.stride(0), p.stride(1), b.stride(0), b.stride(1), out.stride(0),
        PREC="ieee" if b.dtype == torch.float32 else "tf32", **cfg,
    )
    return out
