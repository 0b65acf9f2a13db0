"""Dynamic per-row e4m3 quantization of activations, for the W8A8 products of kernels/fp8_linear.py.

Each row of x [M, K] gets its own scale s = max|x_row| * float32(1/448) (1 for an all-zero row) and
codes x / s rounded to nearest even (``quantize_rows_fp8_ref``). ``quantize_rows_fp8`` is that in one
launch; the Triton helpers ``fp8_row_scale`` / ``fp8_codes`` are the same arithmetic for the kernels
that quantize their own output before an FP8 product (the RMSNorm of kernels/rms_norm.py and the
SiLU-and-mul of kernels/activation.py), so that their codes equal the quantizer's over their
rounded output, bit for bit. What they hand the product is an ``Fp8Rows``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pageflash.kernels.host_math import next_pow2
from pageflash.kernels.kv_store import e4m3_round
from pageflash.kernels.launch import fast_launch

__all__ = ["FP8", "FP8_MAX", "INV_MAX", "Fp8Rows", "quantize_rows_fp8", "quantize_rows_fp8_ref", "rows_config",
           "fp8_row_scale", "fp8_codes"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))  # 1/448 rounded to float32
MAX_ONE_PASS = 16384  # a row of up to this many elements is held in registers (longer: two passes)


class Fp8Rows(NamedTuple):
    """Activations [M, K] already quantized per row for a W8A8 product (what quantize_rows_fp8 would
    make of them): codes float8_e4m3fn [M, K], K-contiguous; scale float32 [M, 1]; dtype, the
    activations' own dtype (the product's output dtype). Made by the launch that computes the
    activations (an RMSNorm, a SiLU-and-mul) when the next linear layer says it takes them
    (``Linear.takes_fp8_rows``); accepted by fp8_linear in place of x."""

    codes: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def device(self) -> torch.device:
        return self.codes.device


def quantize_rows_fp8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row e4m3 codes of activations x [M, K]: (codes [M, K], scales float32 [M, 1]),
    s = max|x_row| / 448 (1 for an all-zero row), codes = x / s rounded to nearest even."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True)
    # times the float32 reciprocal, as torch's CUDA division by a scalar computes it (and the kernel)
    s = torch.where(amax > 0, amax * INV_MAX, torch.ones_like(amax))
    return (xf / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8), s


@triton.jit
def fp8_row_scale(amax, INV_MAX: tl.constexpr):
    """A row's scale from its max |x| (float32): amax * float32(1/448), 1 for an all-zero row."""
    return tl.where(amax > 0.0, amax * INV_MAX, 1.0)


@triton.jit
def fp8_codes(x, s):
    """float32 x / s clamped to +-448 and rounded to the nearest e4m3 value (as float32: the
    conversion to the code dtype is then exact, also under the interpreter)."""
    return e4m3_round(tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0))


@triton.jit
def _quant_rows_kernel(X, Q, S, K, stride_xm, stride_qm, INV_MAX: tl.constexpr, BK: tl.constexpr,
                       ONE_PASS: tl.constexpr):
    # one row per program: its max |x| (a first pass over K unless the row fits one tile), the scale,
    # then the codes
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BK)
    if ONE_PASS:
        ok = offs < K
        x = tl.load(X + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
    else:
        m = tl.zeros([BK], dtype=tl.float32)
        for k0 in range(0, K, BK):
            ok = (k0 + offs) < K
            m = tl.maximum(m, tl.abs(tl.load(X + row * stride_xm + k0 + offs, mask=ok, other=0.0).to(tl.float32)))
        amax = tl.max(m, 0)
    s = fp8_row_scale(amax, INV_MAX)
    tl.store(S + row, s)
    if ONE_PASS:
        tl.store(Q + row * stride_qm + offs, fp8_codes(x, s).to(Q.dtype.element_ty), mask=ok)
    else:
        for k0 in range(0, K, BK):
            ok = (k0 + offs) < K
            x = tl.load(X + row * stride_xm + k0 + offs, mask=ok, other=0.0).to(tl.float32)
            tl.store(Q + row * stride_qm + k0 + offs, fp8_codes(x, s).to(Q.dtype.element_ty), mask=ok)


_quant_rows_kernel = fast_launch(_quant_rows_kernel)


def rows_config(k: int, max_tile: int = MAX_ONE_PASS) -> tuple[bool, int, int]:
    """(one pass, tile, num_warps) of a program that quantizes a row of k elements."""
    one_pass = k <= max_tile
    bk = next_pow2(k) if one_pass else 2048
    return one_pass, bk, 16 if bk >= 16384 else 8 if bk >= 4096 else 4


def quantize_rows_fp8(x: torch.Tensor, max_tile: int = MAX_ONE_PASS) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows_fp8_ref in one launch (a program per row; rows of up to max_tile elements in one
    pass, longer ones in two). Same codes and scales as the reference."""
    if x.dim() != 2 or not x.is_floating_point() or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_fp8: expected a 2-D float x contiguous along K, got {tuple(x.shape)} "
                         f"{x.dtype}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, s
    one_pass, bk, warps = rows_config(k, max_tile)
    _quant_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), INV_MAX=INV_MAX, BK=bk, ONE_PASS=one_pass,
                             num_warps=warps)
    return q, s
