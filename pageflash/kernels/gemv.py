"""Row-streaming GEMV for decode at batch 1-4: y = x @ W^T, memory-bound on W.

Each program owns ROWS consecutive rows of W -- one contiguous piece of memory, since W is
row-major with K contiguous -- and walks it in [R, BK] tiles, row group by row group, through one
software-pipelined loop, so that several tiles of one contiguous stream are in flight at once. The
products are plain fp32 multiply-adds (no tensor cores: at M <= 4 there is nothing for them to
gain, and no padding of x to 16 rows); a row group's sums are reduced and stored when its last K
tile has been added.

On an H100, in CUDA-graph chains that read every weight from HBM, it streams llama-3-8b's
projections at 96-98% of a pure read of the same bytes, against cuBLAS's 93-95% for gate_up/down
and the tensor-core skinny kernel's 93-95% for qkv/o (docs/BENCHMARKS.md). Which kernel a shape
uses is still decided by timing (`skinny_gemm.SkinnyDispatch`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["gemv", "gemv_ref", "MAX_M"]

MAX_M = 4


# M and ROWS are not specialized: one compile per tile config serves every shape (cold start)
@triton.jit(do_not_specialize=["M", "ROWS"])
def _gemv_kernel(
    X, W, Y, M, N, K, ROWS, stride_xm, stride_wn, stride_ym,
    BM: tl.constexpr, R: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
):
    r0 = tl.program_id(0) * ROWS
    offs_m = tl.arange(0, BM)
    offs_r = tl.arange(0, R)
    offs_k = tl.arange(0, BK)
    n_k = tl.cdiv(K, BK)
    acc = tl.zeros([BM, R, BK], dtype=tl.float32)
    for t in tl.range(0, (ROWS // R) * n_k, num_stages=STAGES):
        g = t // n_k
        kc = t - g * n_k
        rows = r0 + g * R + offs_r
        kk = kc * BK + offs_k
        w = tl.load(W + rows[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=(rows[:, None] < N) & (kk[None, :] < K), other=0.0)
        x = tl.load(X + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        if kc == n_k - 1:
            out = tl.sum(acc, axis=2)  # [BM, R]
            tl.store(Y + offs_m[:, None] * stride_ym + rows[None, :], out.to(Y.dtype.element_ty),
                     mask=(offs_m[:, None] < M) & (rows[None, :] < N))
            acc = tl.zeros([BM, R, BK], dtype=tl.float32)


def gemv(x: torch.Tensor, w: torch.Tensor, rows: int = 16, r: int = 4, bk: int = 512, num_stages: int = 4,
         num_warps: int = 4, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] with M <= MAX_M, w: [N, K] (rows contiguous along K), same float dtype. Returns [M, N]
    in x's dtype. rows: rows of W per program (a multiple of r); r x bk: the tile."""
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"gemv: expected 2-D x and w, got {tuple(x.shape)} and {tuple(w.shape)}")
    m, k = x.shape
    n, k2 = w.shape
    if k != k2:
        raise ValueError(f"gemv: x has K={k}, w has K={k2}")
    if not 1 <= m <= MAX_M:
        raise ValueError(f"gemv is for 1 <= M <= {MAX_M} rows, got {m}")
    if x.dtype != w.dtype:
        raise ValueError(f"gemv: dtype mismatch: x {x.dtype}, w {w.dtype}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gemv: x and w must be contiguous along K")
    if rows % r:
        raise ValueError(f"gemv: rows ({rows}) must be a multiple of r ({r})")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out
    bm = 1 if m == 1 else (2 if m == 2 else 4)
    _gemv_kernel[(triton.cdiv(n, rows),)](
        x, w, y, m, n, k, rows, x.stride(0), w.stride(0), y.stride(0),
        BM=bm, R=r, BK=bk, STAGES=num_stages, num_warps=num_warps,
    )
    return y


def gemv_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().t()).to(x.dtype)
