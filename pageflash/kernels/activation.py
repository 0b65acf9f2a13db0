"""act(gate) * up over a fused gate/up projection output, in one Triton kernel: SiLU (SwiGLU) or
GELU's tanh form (GeGLU, Gemma).

Same arithmetic as ``pageflash.layers.activation.silu_and_mul_ref`` / ``gelu_tanh_and_mul_ref`` on
CUDA, operation for operation: ``silu(g) = g / (1 + exp(-g))`` in float32 (libdevice ``expf`` and IEEE
division, as in ATen's silu kernel); ``gelu(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))`` in
float32 (libdevice ``tanhf``, as ATen's); rounded to the input dtype, then multiplied by ``up``
(float32 product, rounded once).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

try:  # libdevice's expf, the function ATen's silu calls (tl.exp lowers to the faster ex2.approx)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older layouts
    from triton.language.extra.cuda import libdevice

from pageflash.kernels.fp8_quant import FP8, INV_MAX, fp8_codes, fp8_row_scale, rows_config
from pageflash.kernels.host_math import cdiv
from pageflash.kernels.launch import fast_launch
from pageflash.layers.activation import gelu_tanh_and_mul_ref, silu_and_mul_ref

__all__ = ["silu_and_mul", "silu_and_mul_ref", "gelu_tanh_and_mul", "gelu_tanh_and_mul_ref"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def silu_f32(g, LIBDEVICE: tl.constexpr):
    """silu(g) of float32 g as ATen computes it: g / (1 + expf(-g)) with libdevice's expf and IEEE
    division (LIBDEVICE False: tl.exp, the interpreter has no libdevice). Shared by the SiLU epilogues
    (here, kernels/gemv.py, kernels/fused_moe.py); callers round it to their output dtype."""
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    return tl.math.div_rn(g, 1.0 + e)


@triton.jit
def gelu_tanh_f32(g, LIBDEVICE: tl.constexpr):
    """GELU's tanh approximation of float32 g as ATen computes it (libdevice's tanhf; LIBDEVICE False:
    tanh through exp, as the interpreter has no libdevice)."""
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    if LIBDEVICE:
        th = libdevice.tanh(inner)
    else:  # tanh(|y|) from exp(-2|y|) <= 1: no overflow
        t = tl.exp(-2.0 * tl.abs(inner))
        th = (1.0 - t) / (1.0 + t)
        th = tl.where(inner < 0, -th, th)
    return 0.5 * g * (1.0 + th)


@triton.jit
def _act_mul(X, t, stride_xt, INTER, cols, mask, LIBDEVICE: tl.constexpr, GELU: tl.constexpr):
    """act(gate) * up of row t's columns cols, as float32 holding the value rounded to X's dtype."""
    g = tl.load(X + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + t * stride_xt + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        act = gelu_tanh_f32(g, LIBDEVICE)
    else:
        act = silu_f32(g, LIBDEVICE)
    act = act.to(X.dtype.element_ty).to(tl.float32)
    return (act * u).to(X.dtype.element_ty).to(tl.float32)


@triton.jit
def _act_and_mul_kernel(
    X, O, stride_xt, stride_ot, INTER,
    BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, GELU: tl.constexpr,
):
    # grid (T, cdiv(INTER, BLOCK))
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    y = _act_mul(X, t, stride_xt, INTER, cols, mask, LIBDEVICE, GELU)
    tl.store(O + t * stride_ot + cols, y.to(O.dtype.element_ty), mask=mask)


@triton.jit
def _act_and_mul_quant_kernel(
    X, O, OS, stride_xt, stride_ot, INTER,
    BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, LIBDEVICE: tl.constexpr, GELU: tl.constexpr,
    INV_MAX: tl.constexpr,
):
    # one row per program: act(gate) * up rounded to X's dtype, its max |.|, the row's scale (OS), then
    # the e4m3 codes (O) -- quantize_rows_fp8 of what _act_and_mul_kernel stores. A row longer than
    # one tile is computed twice (once for the max, once for the codes) rather than stored.
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        mask = offs < INTER
        y = _act_mul(X, t, stride_xt, INTER, offs, mask, LIBDEVICE, GELU)
        amax = tl.max(tl.abs(y), 0)
    else:
        m = tl.zeros([BLOCK], dtype=tl.float32)
        for c0 in range(0, INTER, BLOCK):
            ok = (c0 + offs) < INTER
            m = tl.maximum(m, tl.abs(_act_mul(X, t, stride_xt, INTER, c0 + offs, ok, LIBDEVICE, GELU)))
        amax = tl.max(m, 0)
    s = fp8_row_scale(amax, INV_MAX)
    tl.store(OS + t, s)
    if ONE_PASS:
        tl.store(O + t * stride_ot + offs, fp8_codes(y, s).to(O.dtype.element_ty), mask=mask)
    else:
        for c0 in range(0, INTER, BLOCK):
            ok = (c0 + offs) < INTER
            y = _act_mul(X, t, stride_xt, INTER, c0 + offs, ok, LIBDEVICE, GELU)
            tl.store(O + t * stride_ot + c0 + offs, fp8_codes(y, s).to(O.dtype.element_ty), mask=ok)


_act_and_mul_kernel = fast_launch(_act_and_mul_kernel)  # host launches via the cached CompiledKernel
_act_and_mul_quant_kernel = fast_launch(_act_and_mul_quant_kernel)


def _config(num_tokens: int) -> tuple[int, int]:
    """(BLOCK, num_warps): small blocks for a few tokens so that a decode step spreads over SMs."""
    return (256, 2) if num_tokens <= 16 else (1024, 4)


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None,
                 scale_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x: [T, 2*I] float16/bfloat16/float32 (gate columns, then up; rows may be strided, columns
    contiguous). Returns silu(gate) * up: [T, I] in x's dtype, written to out if given.
    scale_out (float32 [T, 1]): the result as float8_e4m3fn codes instead, each row with its scale in
    scale_out, as quantize_rows_fp8 would make them of it (for an FP8 product next:
    kernels/fp8_quant.py); one program per row."""
    return _act_and_mul(x, out, gelu=False, scale_out=scale_out)


def gelu_tanh_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None,
                      scale_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As silu_and_mul, with GELU's tanh approximation: gelu_tanh(gate) * up."""
    return _act_and_mul(x, out, gelu=True, scale_out=scale_out)


def _act_and_mul(x: torch.Tensor, out: Optional[torch.Tensor], gelu: bool,
                 scale_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    name = "gelu_tanh_and_mul" if gelu else "silu_and_mul"
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"{name}: x must be [T, 2*I], got {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name}: dtype must be float16/bfloat16/float32, got {x.dtype}")
    t, inter = x.shape[0], x.shape[1] // 2
    out_dtype = x.dtype
    if scale_out is not None:
        if scale_out.shape != (t, 1) or scale_out.dtype != torch.float32 or scale_out.device != x.device:
            raise ValueError(f"{name}: scale_out must be float32 [{t}, 1] on {x.device}, got "
                             f"{scale_out.dtype} {tuple(scale_out.shape)} on {scale_out.device}")
        out_dtype = FP8
    if out is None:
        out = torch.empty((t, inter), device=x.device, dtype=out_dtype)
    if out.shape != (t, inter) or out.dtype != out_dtype or out.device != x.device:
        raise ValueError(f"{name}: out must be [{t}, {inter}] {out_dtype} on {x.device}, got {tuple(out.shape)} "
                         f"{out.dtype}")
    for arg, a in (("x", x), ("out", out)):
        if a.stride(1) != 1 and a.shape[1] > 1:
            raise ValueError(f"{name}: {arg} must be contiguous in its last dim (strides {a.stride()})")
    if t == 0 or inter == 0:
        return out
    if scale_out is not None:
        one_pass, block, num_warps = rows_config(inter)
        _act_and_mul_quant_kernel[(t,)](
            x, out, scale_out, x.stride(0), out.stride(0), inter,
            BLOCK=block, ONE_PASS=one_pass, LIBDEVICE=x.is_cuda, GELU=gelu, INV_MAX=INV_MAX,
            num_warps=num_warps, enable_fp_fusion=False,
        )
        return out
    block, num_warps = _config(t)
    _act_and_mul_kernel[(t, cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter,
        BLOCK=block, LIBDEVICE=x.is_cuda, GELU=gelu, num_warps=num_warps, enable_fp_fusion=False,
    )
    return out
