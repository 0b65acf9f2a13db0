"""FP8 (e4m3) linear layers: vLLM's ``quantization="fp8"`` for 16-bit checkpoints (and what FP8
checkpoints run as: model/fp8_checkpoint.py).

Weights: float8_e4m3fn codes [N, K] with one float32 scale per output row, s = max|w_row| / 448
(round to nearest even; an all-zero row gets s = 1), made at load (``quantize_fp8``). Half the bytes
of bf16, like weight-only INT8, with 3 mantissa bits and a wide exponent instead of 7 bits of a
linear grid. What runs, by rows of x (M), on CUDA:

- M < ``PAGEFLASH_FP8_MM_M`` (default 3: decode at batch 1-2): weight-only, the row-streaming GEMV
  of kernels/gemv.py reading e4m3 codes (every e4m3 value is exact in bf16), so these products equal
  the dequantized weight's (a biased product takes w8_linear's widening GEMM instead).
- From there, bf16 activations go W8A8 on the FP8 tensor cores. Each row of x is quantized to e4m3
  with its own dynamic scale (``quantize_rows_fp8``: max|x_row| / 448, one Triton pass), and the
  codes are multiplied with the weight's, float32 sums times both scales, rounded to bf16:
  - up to ``PAGEFLASH_FP8_CUBLAS_M`` - 1 rows (default 128) by ``fp8_mm``, a Triton kernel computing
    y^T = W x^T (the weight rows on the tensor-core instruction's long side, the few tokens on its
    short side), tiles per M and N (``_mm_config``);
  - from there by ``torch._scaled_mm`` (cuBLASLt / CUTLASS) with row-wise scales, which is slow at
    small M (run 54: 0.77-0.93x of bf16 up to 64 rows) and ahead from 256 on.
  This is what vLLM's dynamic FP8 does (its default is one scale per tensor for both; per-row scales
  here). fp16 / float32 activations and GPUs without FP8 tensor cores keep the weight-only kernels
  (w8_linear: GEMV, widening GEMM, dequantize + cuBLAS from 512 rows, as INT8).
- ``PAGEFLASH_FP8_MM_M`` set huge keeps every product weight-only; ``PAGEFLASH_W8_KERNELS=0`` is the
  dequantize-then-F.linear reference, as for INT8.

On CPU every product is the dequantized weight through F.linear (torch has an FP8 ``_scaled_mm`` on
CPU too, but the point there is a reference); ``fp8_scaled_mm_ref`` is the plain reference of the
W8A8 path, which ``fp8_scaled_mm`` is tested against.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from pageflash.envs import int_env
from pageflash.kernels.device_info import has_fp8 as _fp8_tensor_cores
from pageflash.kernels.fp8_quant import (FP8, FP8_MAX, INV_MAX, Fp8Rows, quantize_rows_fp8,
                                         quantize_rows_fp8_ref)
from pageflash.kernels.launch import fast_launch
from pageflash.kernels.w8_linear import run_split_k, w8_linear

__all__ = ["FP8", "FP8_MAX", "Fp8Rows", "quantize_fp8", "quantize_rows_fp8", "quantize_rows_fp8_ref", "fp8_mm",
           "fp8_scaled_mm", "fp8_scaled_mm_ref", "fp8_linear", "takes_fp8_rows"]

# rows of bf16 x: W8A8 from _MM_M on (below, the weight-only GEMV), through torch._scaled_mm from
# _CUBLAS_M on (below, the Triton kernel): scripts/fp8_probe.py, docs/BENCHMARKS.md run 54
_MM_M = 3
_CUBLAS_M = 129


def quantize_fp8(w: torch.Tensor, rows_per_chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 codes of w [N, K]: (q float8_e4m3fn [N, K], s float32 [N]) with w ~= q * s[:, None],
    s = max|w_row| * float32(1 / 448) (an all-zero row gets s = 1), rounded to nearest even. Computed in float32,
    rows_per_chunk rows at a time (bounded scratch memory on large weights)."""
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_fp8: expected a 2-D float weight, got {tuple(w.shape)} {w.dtype}")
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    s = torch.empty(n, dtype=torch.float32, device=w.device)
    for r0 in range(0, n, rows_per_chunk):
        wf = w[r0: r0 + rows_per_chunk].float()
        amax = wf.abs().amax(dim=1)
        if not torch.isfinite(amax).all():
            raise ValueError("quantize_fp8: the weight holds inf or nan")
        # times float32(1/448), as on every device (torch's CUDA division by a scalar multiplies by the
        # reciprocal, its CPU one divides): the same codes wherever a model is quantized
        sc = torch.where(amax > 0, amax * INV_MAX, torch.ones_like(amax))
        q[r0: r0 + rows_per_chunk] = (wf / sc[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
        s[r0: r0 + rows_per_chunk] = sc
    return q, s


@triton.jit(do_not_specialize=["M"])
def _fp8_mm_kernel(
    XQ, SX, W, SW, BIAS, Y, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
    BN: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
):
    # y^T = W x^T ("swap AB"): the weight's rows fill the tensor-core instruction's long M side and
    # the few tokens its short N side, both operands e4m3 and K-contiguous, products in float32.
    # Grid (N blocks, M blocks, SPLIT_K); SPLIT_K > 1: each K range's scaled float32 partial goes to
    # Y + pid_k * stride_ys (the caller sums them, then adds the bias).
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_per = tl.cdiv(K, SPLIT_K * BK) * BK
    k_start = pid_k * k_per
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + (k_start + offs_k)[None, :]
    x_ptrs = XQ + offs_m[None, :].to(tl.int64) * stride_xm + (k_start + offs_k)[:, None]
    sx = tl.load(SX + offs_m, mask=m_ok, other=0.0)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BK):
        k_ok = (k0 + offs_k) < K
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        if FAST_ACCUM:  # the running sum inside the tensor cores' FP8 accumulation (reduced precision on
            acc = tl.dot(w, x, acc)  # Hopper, which Triton keeps for the whole loop by default there)
        else:  # each K tile's dot on its own, added to the float32 sum (cuBLAS's default)
            acc += tl.dot(w, x)
        w_ptrs += BK
        x_ptrs += BK
    acc = acc * tl.load(SW + offs_n, mask=n_ok, other=0.0)[:, None] * sx[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(Y + pid_k * stride_ys + offs_m[None, :].to(tl.int64) * stride_ym + offs_n[:, None],
             acc.to(Y.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


_fp8_mm_kernel = fast_launch(_fp8_mm_kernel)


def _mm_config(m: int, n: int, k: int) -> tuple[int, ...]:
    """(BN, BM, BK, SPLIT_K, num_warps, num_stages) of the Triton W8A8 kernel for M rows of x: the
    winners of scripts/fp8_probe.py on an H200 over llama-3-8b's projections (docs/BENCHMARKS.md run
    54). 64 weight rows a program, 256-deep K steps, 4 stages; gate_up (N >= 16384) 128 rows and 3
    stages up to 16 tokens, 128-deep steps above; 65-128 tokens one 128-token block with 8 warps for
    the wide projections (the H100 probe of the same run agrees); large M 128 x 128 tiles."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    if m > 128:
        return 128, 128, 128, 1, 8, 3
    if m > 64:  # one block of 128 tokens, 8 warps (H200 and H100: gate_up 1.7x / 1.55x the 64-token tiles)
        return (128, 128, 128, 1, 8, 3) if n >= 16384 else (64, 128, 256, 1, 8, 4) if n >= 6144 else (64, 64, 256, 1, 4, 4)
    if n >= 16384:
        return (128, 16, 256, 1, 4, 3) if m <= 16 else (64, bm, 128, 1, 4, 3)
    return 64, bm, 256, 1, 4, 4


def _rows(x) -> Fp8Rows:
    """x's rows quantized (quantize_rows_fp8), or x itself when it already is an Fp8Rows."""
    if isinstance(x, Fp8Rows):
        return x
    xq, sx = quantize_rows_fp8(x.contiguous() if x.stride(1) != 1 else x)
    return Fp8Rows(xq, sx, x.dtype)


def fp8_mm(x, q: torch.Tensor, s: torch.Tensor, bias: Optional[torch.Tensor] = None,
           config: Optional[tuple[int, ...]] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W8A8 in Triton: x [M, K] (16-bit or float32) quantized per row (quantize_rows_fp8's codes and
    scales; or an Fp8Rows, x's rows quantized already), times q [N, K] e4m3 with s [N] on the tensor
    cores (y^T = W x^T); out in x's dtype (+ bias, added in float32 before the one rounding). config:
    (BN, BM, BK, SPLIT_K, num_warps, num_stages). The sum over K runs in the tensor cores' FP8
    accumulation (``fast_accum``). The activations are quantized by their own launch
    first, or by the launch that made them (Fp8Rows): quantizing them inside this kernel (a first pass
    over K for the scales, then each tile divided and rounded in registers) was 3-10x slower
    (docs/KERNELS.md, "FP8 linears")."""
    _check(x, q, s, bias, "fp8_mm")
    m, k = x.shape
    n = q.shape[0]
    bn, bm, bk, split_k, warps, stages = config or _mm_config(m, n, k)
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    xq, sx, _ = _rows(x)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split_k)
    fast = fast_accum()

    def launch(y: torch.Tensor, stride_ym: int, stride_ys: int, b: Optional[torch.Tensor]) -> None:
        _fp8_mm_kernel[grid](xq, sx, q, s, s if b is None else b, y, m, n, k, xq.stride(0), q.stride(0), stride_ym,
                             stride_ys, BN=bn, BM=bm, BK=bk, SPLIT_K=split_k, HAS_BIAS=b is not None,
                             FAST_ACCUM=fast, num_warps=warps, num_stages=stages)

    return run_split_k(launch, out, bias, split_k)


def fast_accum() -> bool:
    """Whether the FP8 Triton GEMMs (fp8_mm, the W8A8 MoE experts) let the tensor cores accumulate
    over the whole K loop, as Triton does by default on Hopper (reduced precision: up to 1.5% of the
    largest output away from the float32 sum at K 14336, run 54), rather than adding each K tile's dot
    to a float32 sum. PAGEFLASH_FP8_FAST_ACCUM: 1 (the default; vLLM's CUTLASS FP8 kernels take
    fast accumulation too) or 0. The precise sum cost llama-3-8b fp8 1.3% / 3.2% at batch 16 / 64
    (run 56); the error fast accumulation adds stays below what quantizing the activations to e4m3
    adds (~3.6% of each product's norm)."""
    return os.environ.get("PAGEFLASH_FP8_FAST_ACCUM", "1") != "0"


def _check(x, q: torch.Tensor, s: torch.Tensor, bias: Optional[torch.Tensor], who: str) -> None:
    if len(x.shape) != 2 or q.dim() != 2 or x.shape[1] != q.shape[1]:
        raise ValueError(f"{who}: expected x [M, K] and q [N, K], got {tuple(x.shape)} and {tuple(q.shape)}")
    if q.dtype != FP8 or s.dtype != torch.float32 or s.shape != (q.shape[0],):
        raise ValueError(f"{who}: expected float8_e4m3fn q [N, K] and float32 s [N]; got q {q.dtype}, "
                         f"s {s.dtype} {tuple(s.shape)}")
    if bias is not None and bias.shape != (q.shape[0],):
        raise ValueError(f"{who}: bias must be [{q.shape[0]}], got {tuple(bias.shape)}")
    if isinstance(x, Fp8Rows) and (x.codes.dtype != FP8 or x.codes.stride(1) != 1 or x.scale.dtype != torch.float32
                                   or x.scale.shape != (x.shape[0], 1)):
        raise ValueError(f"{who}: an Fp8Rows needs K-contiguous float8_e4m3fn codes [M, K] and float32 scales "
                         f"[M, 1]; got {x.codes.dtype} codes {tuple(x.codes.shape)} strides {x.codes.stride()}, "
                         f"{x.scale.dtype} scales {tuple(x.scale.shape)}")


def fp8_scaled_mm_ref(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The W8A8 reference: x's rows quantized (quantize_rows_fp8_ref), the product of the codes in
    float32 times both scales (+ bias), rounded to x's dtype."""
    _check(x, q, s, bias, "fp8_scaled_mm_ref")
    xq, sx = quantize_rows_fp8_ref(x)
    y = (xq.float() @ q.float().t()) * sx * s
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def scaled_mm_applies(x, q: torch.Tensor) -> bool:
    """Whether fp8_scaled_mm can run this product: CUDA, bf16 x, K and N multiples of 16
    (cuBLASLt's FP8 layouts), and a GPU with FP8 tensor cores (compute capability >= 8.9)."""
    dev = x.device
    return (dev.type == "cuda" and x.dtype == torch.bfloat16 and x.shape[1] % 16 == 0 and q.shape[0] % 16 == 0
            and fp8_tensor_cores(dev))


def fp8_tensor_cores(dev: torch.device) -> bool:
    """Whether the CUDA device dev (index None: the current one) has FP8 tensor cores (compute
    capability >= 8.9): where the W8A8 products and MoE experts run."""
    return _fp8_tensor_cores(dev.index if dev.index is not None else torch.cuda.current_device())



def fp8_scaled_mm(x, q: torch.Tensor, s: torch.Tensor,
                  bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """W8A8: x [M, K] bf16 quantized per row (quantize_rows_fp8; or an Fp8Rows of bf16 activations),
    times q [N, K] e4m3 with s [N], on the FP8 tensor cores through torch._scaled_mm's row-wise
    scaling; bf16 out (+ bias, added after the rounding). Only where scaled_mm_applies."""
    _check(x, q, s, bias, "fp8_scaled_mm")
    if not scaled_mm_applies(x, q):
        raise ValueError("fp8_scaled_mm: needs CUDA (compute capability >= 8.9), bf16 x and K, N multiples of 16")
    xq, sx, _ = _rows(x)
    y = torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)
    return y if bias is None else y + bias


def _mm_min_m() -> int:
    """Rows of bf16 x from which products go W8A8 (PAGEFLASH_FP8_MM_M; below: the weight-only GEMV)."""
    if os.environ.get("PAGEFLASH_W8_KERNELS", "1") == "0":
        return 1 << 62
    return int_env("PAGEFLASH_FP8_MM_M", _MM_M)


def _w8a8(x, q: torch.Tensor) -> bool:
    """Whether fp8_linear runs x [M, K] times the e4m3 q W8A8 (quantizing x's rows), not weight-only."""
    return len(x.shape) == 2 and x.shape[0] >= max(1, _mm_min_m()) and scaled_mm_applies(x, q)


def takes_fp8_rows(x, q: torch.Tensor) -> bool:
    """Whether fp8_linear(x, q, ...) would quantize x's rows: then the launch that computes x may
    quantize them itself and hand the product an Fp8Rows instead (x: the activations, or anything
    with their shape, dtype and device). PAGEFLASH_FP8_FUSED_QUANT=0: never (each product quantizes
    its own input, one launch more)."""
    return os.environ.get("PAGEFLASH_FP8_FUSED_QUANT", "1") != "0" and _w8a8(x, q)


def fp8_linear(x, q: torch.Tensor, s: torch.Tensor, bias: Optional[torch.Tensor] = None,
               float_out: bool = False) -> torch.Tensor:
    """x [M, K] @ (q * s)^T (+ bias) for e4m3 weights. bf16 x on CUDA with FP8 tensor cores: the
    weight-only GEMV below PAGEFLASH_FP8_MM_M rows (unbiased), then W8A8: the Triton kernel (fp8_mm)
    up to PAGEFLASH_FP8_CUBLAS_M - 1 rows, torch._scaled_mm from there. Otherwise the weight-only 8-bit
    kernels (w8_linear; the dequantized weight on CPU). x may be an Fp8Rows (rows quantized already,
    where takes_fp8_rows said so): W8A8 by its rows. float_out: widened to float32 after the rounding."""
    if isinstance(x, Fp8Rows) or _w8a8(x, q):
        if x.shape[0] >= int_env("PAGEFLASH_FP8_CUBLAS_M", _CUBLAS_M) and x.dtype == torch.bfloat16:
            y = fp8_scaled_mm(x, q, s, bias)
        else:
            y = fp8_mm(x, q, s, bias)
        return y.float() if float_out else y
    return w8_linear(x, q, s, bias, float_out)
