"""Weight-only INT8 linear layers: y = x (q * s)^T, with q int8 [N, K] and s float32 [N].

Decode is memory-bound on the weights (docs/BENCHMARKS.md, W-decode1), so storing them as int8 codes
with one scale per output row halves the bytes a step reads. The activations stay in 16-bit; the
codes are widened in registers (an int8 is exact in bf16 and fp16) and each output's fp32 sum is
multiplied by its row's scale once, after the K loop (symmetric, per-channel: the scale factors out
of the sum).

Kernels, by rows of x (M), on CUDA:
- M <= 2 (decode at batch 1-2): the row-streaming GEMV of kernels/gemv.py with ``scale`` (the
  same kernel reads bf16 or int8 rows). Its SiLU-and-mul epilogue works over int8 rows too, but is
  not used: unfused was 0.6% faster (layers/linear.py ``gate_up_silu``).
- 2 < M < 512: ``w8_gemm`` below, a tiled tensor-core GEMM whose W tiles are loaded as int8 and
  widened before the dot; the scale (and bias) in the epilogue; split-K for long K (down). Its tile
  follows M, N and K (``_gemm_config``, from scripts/w8_probe.py).
- M >= 512 (``PAGEFLASH_W8_DEQUANT_M`` overrides): W dequantized to x's dtype in one pass into a
  scratch tensor (up to out x in x's dtype: 235 MB for llama-3-8b's gate_up), then cuBLAS.
Against bf16 weights through cuBLAS / the bf16 GEMV, an H100 runs llama-3-8b's projections 1.3-1.8x
faster up to M = 32, about even at 64, slower at 128-256 and 0.7-1.0x at prefill sizes
(docs/BENCHMARKS.md runs 29 and 31): INT8 here buys small-batch latency and memory, not
large-batch throughput.
- ``PAGEFLASH_W8_KERNELS=0``: always that dequantize-then-F.linear path (the reference the GPU tests
  compare the kernels' engine output with; the path taken on CPU).

``quantize_int8`` makes the codes (round to nearest, max |w| of a row -> 127); ``w8_linear_ref`` is
the plain reference every kernel is tested against.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from pageflash.envs import int_env, int_tuple_env
from pageflash.kernels.device_info import high_bandwidth_per_sm, memory_bandwidth_per_sm
from pageflash.kernels.gemv import CODE_DTYPES, gemv
from pageflash.kernels.host_math import cdiv
from pageflash.kernels.launch import fast_launch

__all__ = ["CODE_DTYPES", "quantize_int8", "dequantize_int8", "dequantize_int8_fast", "w8_linear", "w8_linear_ref", "w8_gemm"]


def quantize_int8(w: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8 codes of w [N, K]: (q int8 [N, K], s float32 [N]) with w ~= q * s[:, None],
    |q| <= 127, s = max|w_row| / 127 (an all-zero row gets s = 1). Computed in float32, rows_per_chunk
    rows at a time (bounded scratch memory on large weights)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_int8: expected a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    s = torch.empty(n, dtype=torch.float32, device=w.device)
    for r0 in range(0, n, rows_per_chunk):
        wf = w[r0: r0 + rows_per_chunk].float()
        amax = wf.abs().amax(dim=1)
        if not torch.isfinite(amax).all():
            raise ValueError("quantize_int8: the weight holds inf or nan")
        sc = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
        q[r0: r0 + rows_per_chunk] = torch.round(wf / sc[:, None]).clamp_(-127, 127).to(torch.int8)
        s[r0: r0 + rows_per_chunk] = sc
    return q, s


def dequantize_int8(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * s[:, None] in dtype (the product computed in float32, then rounded)."""
    return (q.float() * s[:, None]).to(dtype)


def w8_linear_ref(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The reference: x [M, K] @ (q * s)^T in float32 (+ bias), rounded to x's dtype."""
    y = (x.float() @ q.float().t()) * s
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@triton.jit
def _dequant_int8_kernel(Q, S, W, K, stride_qn, stride_wn, BK: tl.constexpr):
    # one row of q per program along axis 0, BK codes per program along axis 1
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BK + tl.arange(0, BK)
    ok = offs < K
    q = tl.load(Q + row * stride_qn + offs, mask=ok, other=0.0)
    tl.store(W + row * stride_wn + offs, (q.to(tl.float32) * tl.load(S + row)).to(W.dtype.element_ty), mask=ok)


_dequant_int8_kernel = fast_launch(_dequant_int8_kernel)


def dequantize_int8_fast(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """dequantize_int8 in one pass on CUDA (reads the codes once, writes dtype once), elsewhere the
    reference. Same values: q * s in float32, rounded."""
    if not q.is_cuda:
        return dequantize_int8(q, s, dtype)
    n, k = q.shape
    w = torch.empty(n, k, dtype=dtype, device=q.device)
    _dequant_int8_kernel[(n, cdiv(k, 2048))](q, s, w, k, q.stride(0), w.stride(0), BK=2048, num_warps=4)
    return w


@triton.jit(do_not_specialize=["M"])
def _w8_gemm_kernel(
    X, W, S, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # programs in groups of GROUP_M row blocks per column block, so that concurrent programs share
    # W tiles in L2 (the usual grouped order); at decode sizes there is one row block.
    # SPLIT_K > 1: program_id(1) takes one of SPLIT_K ranges of K and stores its scaled float32
    # partial at Y + pid_k * stride_ys (the caller sums them and adds the bias)
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    per_group = GROUP_M * n_n
    first_m = (pid // per_group) * GROUP_M
    group = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group
    pid_n = (pid % per_group) // group
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_per = tl.cdiv(K, SPLIT_K * BK) * BK
    k_start = pid_k * k_per
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + (k_start + offs_k)[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BK):
        k_ok = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.trans(w.to(x.dtype))  # int8 / e4m3 codes -> x's dtype: exact
        if IEEE:  # float32 activations (tests, CPU parity): no TF32 rounding
            acc = tl.dot(x, wt, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, wt, acc)
        x_ptrs += BK
        w_ptrs += BK
    acc = acc * tl.load(S + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + pid_k * stride_ys + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
             acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


_w8_gemm_kernel = fast_launch(_w8_gemm_kernel)  # host launches via the cached CompiledKernel


def _check(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: Optional[torch.Tensor], who: str) -> None:
    if x.dim() != 2 or q.dim() != 2:
        raise ValueError(f"{who}: expected 2-D x and q, got {tuple(x.shape)} and {tuple(q.shape)}")
    if x.shape[1] != q.shape[1]:
        raise ValueError(f"{who}: x has K={x.shape[1]}, q has K={q.shape[1]}")
    if q.dtype not in CODE_DTYPES or s.dtype != torch.float32 or s.shape != (q.shape[0],):
        raise ValueError(f"{who}: expected int8 or float8_e4m3fn q [N, K] and float32 s [N]; got q {q.dtype}, "
                         f"s {s.dtype} {tuple(s.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{who}: x must be a float tensor, got {x.dtype}")
    if x.stride(1) != 1 or q.stride(1) != 1 or s.stride(0) != 1:
        raise ValueError(f"{who}: x, q and s must be contiguous along K (s: along N)")
    if bias is not None and (bias.shape != (q.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"{who}: bias must be a contiguous [{q.shape[0]}] vector, got {tuple(bias.shape)}")


def _gemm_config(m: int, n: int, k: int) -> tuple[int, ...]:
    """(BM, BN, BK, GROUP_M, num_warps, num_stages[, SPLIT_K]) for M rows of x, N outputs and K
    inputs: the winners of scripts/w8_probe.py on an H100 over llama-3-8b's projections (N 4096 /
    6144 / 28672, K 4096 / 14336), per M range (M < 512; from 512 on the dispatch dequantizes).
    Small M: a narrow N tile, so that enough programs stream W; N >= 16384 (gate_up) takes wider
    tiles earlier, since it has programs to spare; K >= 8192 (down) splits K instead."""
    wide = n >= 16384
    if m <= 16:
        return 16, 32, 256, 1, 4, 4
    if k >= 8192:  # down (K 14336): split-K, wider tiles
        return ((32, 64, 128, 1, 4, 4, 4) if m <= 32 else (64, 64, 256, 1, 4, 3, 2) if m <= 64
                else (64, 128, 128, 1, 4, 3, 4) if m <= 128 else (128, 128, 64, 8, 8, 4, 4))
    if m <= 32:
        return (32, 128, 128, 1, 4, 4) if wide else (16, 32, 256, 16, 4, 4)
    if m <= 64:
        return (64, 128, 128, 1, 4, 3) if wide else (64, 64, 256, 1, 4, 3) if n >= 6144 else (64, 32, 256, 1, 4, 4)
    if m <= 128:
        return (128, 128, 64, 8, 8, 4) if wide else (64, 64, 128, 1, 4, 4) if n >= 6144 else (64, 64, 256, 1, 4, 3)
    if m <= 256:
        return (128, 128, 64, 8, 8, 4) if wide else (128, 128, 128, 8, 8, 3) if n >= 6144 else (64, 64, 128, 1, 4, 4)
    if m <= 512:
        return (128, 128, 64, 8, 4, 4) if n >= 6144 else (128, 128, 128, 8, 8, 3)
    return 128, 128, 64, 8, 4, 4


def w8_gemm(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: Optional[torch.Tensor] = None,
            config: Optional[tuple[int, ...]] = None,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K] (float, rows contiguous) @ (q int8 [N, K] * s float32 [N])^T (+ bias [N]) -> [M, N] in
    x's dtype (or out: [M, N] contiguous, x's dtype or float32). config: (BM, BN, BK, GROUP_M,
    num_warps, num_stages[, SPLIT_K]); None picks by M. SPLIT_K > 1: float32 partials over K ranges,
    summed here (then the bias, then the rounding)."""
    _check(x, q, s, bias, "w8_gemm")
    m, k = x.shape
    n = q.shape[0]
    bm, bn, bk, group_m, warps, stages, *rest = config or _gemm_config(m, n, k)
    split_k = rest[0] if rest else 1
    if x.dtype == torch.float32 and config is None:  # twice the bytes per tile: keep shared memory in bounds
        bk, stages = max(32, bk // 2), min(stages, 3)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"w8_gemm: out must be [{m}, {n}] {x.dtype} or float32, contiguous along N; got "
                         f"{tuple(out.shape)} {out.dtype}")
    if m == 0:
        return out
    grid = (cdiv(m, bm) * cdiv(n, bn), split_k)

    def launch(y: torch.Tensor, stride_ym: int, stride_ys: int, b: Optional[torch.Tensor]) -> None:
        _w8_gemm_kernel[grid](
            x, q, s, s if b is None else b, y, m, n, k, x.stride(0), q.stride(0), stride_ym, stride_ys,
            BM=bm, BN=bn, BK=bk, GROUP_M=group_m, HAS_BIAS=b is not None, IEEE=x.dtype == torch.float32,
            SPLIT_K=split_k, num_warps=warps, num_stages=stages,
        )

    return run_split_k(launch, out, bias, split_k)


def run_split_k(launch, out: torch.Tensor, bias: Optional[torch.Tensor], split_k: int) -> torch.Tensor:
    """Run a GEMM kernel that takes SPLIT_K ranges of K: launch(y, stride_ym, stride_ys, bias) writes
    y (out itself with the bias when split_k == 1; else float32 partials [split_k, M, N] without it,
    summed here, then the bias added, then one rounding into out, as the unsplit kernel rounds)."""
    if split_k == 1:
        launch(out, out.stride(0), 0, bias)
        return out
    m, n = out.shape
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=out.device)
    launch(part, part.stride(1), part.stride(0), None)
    y = part.sum(0)
    if bias is not None:
        y += bias.float()
    out.copy_(y)
    return out


# rows of W per GEMV program and its tile (rows, r, bk, num_stages, num_warps): scripts/w8_probe.py's
# winner at M = 1 on every llama-3-8b shape (an [8, 512] int8 tile is as many bytes as the bf16
# GEMV's [4, 512]). At M >= 3 the tensor-core GEMM's 16-row tile was faster (docs/BENCHMARKS.md).
_GEMV_CFG = (8, 8, 512, 4, 4)
# Where the peak bandwidth per SM exceeds device_info.STAGES_BW_PER_SM (H200), as the bf16 GEMV's
# tile there: 3 stages of [8, 1024] (scripts/w8_gemv_probe.py's best for int8 and e4m3, with the codes
# read as words; W-decode1 -q int8 320.4 -> 344.5 tok/s, -q fp8 340.3 -> 360.3, docs/BENCHMARKS.md
# run 62). The H100 keeps the tile above (not re-measured since the words).
_GEMV_CFG_HIGH_BW = (8, 8, 1024, 3, 4)
GEMV_MAX_ROWS = 2
# from this M on: dequantize in one pass (dequantize_int8_fast), then cuBLAS: faster than the Triton
# GEMM from 512 rows on (docs/BENCHMARKS.md run 31)
_DEQUANT_M = 512


def w8_gemv_cfg(device: Optional[torch.device] = None) -> tuple[int, int, int, int, int]:
    """The 8-bit GEMV's config on this device: PAGEFLASH_W8_GEMV_CFG="rows,r,bk,stages,warps" (for
    A/Bs) if set, else by the peak bandwidth per SM (as skinny_gemm.gemv_tile): _GEMV_CFG_HIGH_BW
    above STAGES_BW_PER_SM, _GEMV_CFG otherwise (and without a CUDA device)."""
    cfg = int_tuple_env("PAGEFLASH_W8_GEMV_CFG", None, (False, True, True, False, True))
    if cfg is None:
        high = device is not None and device.type == "cuda" and high_bandwidth_per_sm(
            memory_bandwidth_per_sm(torch.cuda.get_device_properties(device)))
        return _GEMV_CFG_HIGH_BW if high else _GEMV_CFG
    if cfg[0] % cfg[1]:
        raise ValueError(f"PAGEFLASH_W8_GEMV_CFG: rows ({cfg[0]}) must be a multiple of r ({cfg[1]})")
    return cfg



def _dequant_min_m() -> int:
    if os.environ.get("PAGEFLASH_W8_KERNELS", "1") == "0":
        return 0
    return int_env("PAGEFLASH_W8_DEQUANT_M", _DEQUANT_M)


def w8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: Optional[torch.Tensor] = None,
              float_out: bool = False) -> torch.Tensor:
    """x [M, K] @ (q * s)^T (+ bias) -> [M, N] in x's dtype (float_out: widened to float32 after the
    rounding, as ``.float()`` of it). CUDA: the GEMV at 1 <= M <= GEMV_MAX_ROWS without a bias, the
    Triton GEMM below _DEQUANT_M rows (and for a bias, which it adds in float32 before the one
    rounding, as F.linear does), then dequantize + cuBLAS (module docstring); elsewhere (CPU): the
    dequantized weight through F.linear."""
    m = x.shape[0]
    if not x.is_cuda or m >= _dequant_min_m():
        y = torch.nn.functional.linear(x, dequantize_int8_fast(q, s, x.dtype), bias)
        return y.float() if float_out else y
    if 1 <= m <= GEMV_MAX_ROWS and bias is None:
        y = gemv(x, q, *w8_gemv_cfg(x.device), scale=s)  # gemv validates the operands itself
    else:
        y = w8_gemm(x, q, s, bias)
    return y.float() if float_out else y
