"""RMSNorm, optionally fused with the residual add, in one Triton kernel (one program per row).

The arithmetic follows transformers' LlamaRMSNorm (``rms_norm_ref``) step for step, so that greedy
outputs stay close to HF's bit for bit:

    s    = x + residual                     (in x's dtype: float32 add, rounded; only with residual)
    xn   = float32(s) * rsqrt(mean(float32(s)^2) + eps)
    out  = weight * xn.to(x.dtype)          (product rounded once, in promote(x, weight) dtype)

or, with ``unit_offset`` (GemmaRMSNorm), ``out = (xn * (1 + float32(weight))).to(x.dtype)``.
With ``pre_weight`` (Gemma 2/3's sandwich norms), x is first normed with it (rounded to x's dtype),
then added to the residual: the two norms and the add of a layer boundary in one launch. With
``x_scale`` (Granite's residual_multiplier), x is multiplied by it (float32, rounded to x's dtype)
before the add.

Everything but the sum of squares matches PyTorch's CUDA kernels operation for operation (rsqrt from
libdevice like CUDA's ``rsqrtf``, the mean as ``sum * (1/H)`` like ATen's MeanOps, no FMA
contraction); the summation order differs, so ``out`` can differ from the reference by one rounding
step in rare elements. ``new_residual`` is bitwise equal to ``x + residual``.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import triton
import triton.language as tl

try:  # libdevice's rsqrtf, the function ATen's rsqrt calls (tl.math.rsqrt may lower differently)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older layouts
    from triton.language.extra.cuda import libdevice

from pageflash.kernels.fp8_quant import FP8, INV_MAX, fp8_codes, fp8_row_scale
from pageflash.kernels.host_math import next_pow2
from pageflash.kernels.launch import fast_launch
from pageflash.layers.norm import rms_norm_ref

__all__ = ["rms_norm", "rms_norm_ref", "rms_norm_fused_ref", "qk_rms_norm_", "qk_rms_norm_ref"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 65536  # the whole row lives in registers


@triton.jit
def _normed(x, w, inv_h, eps, LIBDEVICE: tl.constexpr, UNIT_OFFSET: tl.constexpr):
    """rms_norm_ref's arithmetic on one row x (the sum of squares aside): float32(x) * rsqrt(mean + eps)
    rounded to x's dtype, times w in float32 (exact for 16-bit operands); UNIT_OFFSET (Gemma): not
    rounded, times 1 + w in float32. The caller rounds once."""
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=0) * inv_h + eps
    if LIBDEVICE:
        rstd = libdevice.rsqrt(ms)
    else:  # interpreter (no libdevice)
        rstd = tl.math.rsqrt(ms)
    if UNIT_OFFSET:
        return (xf * rstd) * (1.0 + w.to(tl.float32))
    xn = (xf * rstd).to(x.dtype)
    return xn.to(tl.float32) * w.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    X, R, W, O, RO, PW, OS,
    stride_x, stride_r, stride_o, stride_ro,
    H, inv_h, eps, x_scale,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, UNIT_OFFSET: tl.constexpr,
    PRE: tl.constexpr, SCALE_X: tl.constexpr, QUANT: tl.constexpr, INV_MAX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(X + t * stride_x + cols, mask=mask, other=0.0)
    # issued with x, not after the reduction: a one-row norm (batch-1 decode) is a chain of memory
    # latencies, and this one need not wait
    w = tl.load(W + cols, mask=mask, other=0.0)
    if PRE:  # x normed with PW first (rounded to x's dtype, as a separate norm would store it)
        x = _normed(x, tl.load(PW + cols, mask=mask, other=0.0), inv_h, eps, LIBDEVICE,
                    UNIT_OFFSET).to(X.dtype.element_ty)
    if SCALE_X:  # x * a Python float, as PyTorch computes it: in float32, rounded to x's dtype
        x = (x.to(tl.float32) * x_scale).to(X.dtype.element_ty)
    if HAS_RES:
        r = tl.load(R + t * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(RO + t * stride_ro + cols, x, mask=mask)
    y = _normed(x, w, inv_h, eps, LIBDEVICE, UNIT_OFFSET)
    if QUANT:  # the rounded output's e4m3 codes and scale (OS), as quantize_rows_fp8 would make them
        y = y.to(X.dtype.element_ty).to(tl.float32)
        s = fp8_row_scale(tl.max(tl.abs(y), 0), INV_MAX)
        tl.store(OS + t, s)
        tl.store(O + t * stride_o + cols, fp8_codes(y, s).to(O.dtype.element_ty), mask=mask)
    else:
        tl.store(O + t * stride_o + cols, y.to(O.dtype.element_ty), mask=mask)


_rms_norm_kernel = fast_launch(_rms_norm_kernel)  # host launches via the cached CompiledKernel


def rms_norm_fused_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, unit_offset: bool = False,
    pre_weight: Optional[torch.Tensor] = None, x_scale: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm_ref(x + residual), x + residual): what the fused form computes (with pre_weight, x
    is rms_norm_ref(x, pre_weight) first; with x_scale, x * x_scale)."""
    if pre_weight is not None:
        x = rms_norm_ref(x, pre_weight, eps, unit_offset)
    if x_scale is not None:
        x = x * x_scale
    s = x + residual
    return rms_norm_ref(s, weight, eps, unit_offset), s


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 512))  # ~16 elements per thread: 2 x 16-byte loads of bf16


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
    residual_out: Optional[torch.Tensor] = None,
    num_warps: Optional[int] = None,
    unit_offset: bool = False,
    pre_weight: Optional[torch.Tensor] = None,
    x_scale: Optional[float] = None,
    scale_out: Optional[torch.Tensor] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """RMSNorm of each row of x, optionally after adding residual (unit_offset: Gemma's, scaled by
    1 + weight, the output in x's dtype). pre_weight (with residual; x's dtype, as weight): x is
    first normed with it, as rms_norm(x, pre_weight) would store it (Gemma 2/3's norm of a block's
    output before the residual add). x_scale (with residual): x * x_scale is what is added (Granite's
    residual_multiplier; after pre_weight's norm when both are given).

    x: [T, H] float16/bfloat16/float32, rows may be strided (H contiguous). weight: [H], contiguous.
    residual: [T, H], x's dtype. Returns out [T, H] in promote(x.dtype, weight.dtype); with residual,
    (out, new_residual) where new_residual = x + residual ([T, H], x's dtype) and out is its norm.

    scale_out (float32 [T, 1]; x's dtype the output's): out holds float8_e4m3fn codes of the rows
    instead, each with its scale in scale_out, as quantize_rows_fp8 would make them of the output
    (for an FP8 product next: kernels/fp8_quant.py). On the GPU this is its own compile of the
    kernel, whose sum of squares may be added in another order than the unquantized launch's (the
    1-byte store can change the layout), so a rare element may round the other way.

    out / residual_out: where to write (default: new contiguous tensors). Each may alias x or
    residual (every program reads its row before writing it), so ``residual_out=residual`` updates the
    residual in place; they must not alias each other. No host synchronisation (CUDA-graph safe).
    """
    if x.dim() != 2:
        raise ValueError(f"rms_norm: x must be [T, H], got shape {tuple(x.shape)}")
    t, h = x.shape
    if x.dtype not in _DTYPES or weight.dtype not in _DTYPES:
        raise TypeError(f"rms_norm: x/weight dtype must be float16/bfloat16/float32, got {x.dtype}/{weight.dtype}")
    if weight.shape != (h,) or weight.stride(0) != 1:
        raise ValueError(f"rms_norm: weight must be contiguous [{h}], got {tuple(weight.shape)} stride {weight.stride()}")
    if h > MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {h} exceeds the kernel's limit {MAX_HIDDEN}")
    if pre_weight is not None and (residual is None or pre_weight.shape != (h,) or pre_weight.stride(0) != 1
                                   or pre_weight.dtype != weight.dtype or pre_weight.device != x.device):
        raise ValueError(f"rms_norm: pre_weight needs a residual and must be contiguous [{h}] {weight.dtype} "
                         f"on {x.device}")
    if x_scale is not None and residual is None:
        raise ValueError("rms_norm: x_scale needs a residual (it scales what is added to it)")
    out_dtype = x.dtype if unit_offset else torch.promote_types(x.dtype, weight.dtype)
    tensors = [("x", x)]
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"rms_norm: residual must match x ({tuple(x.shape)}, {x.dtype}), "
                f"got {tuple(residual.shape)}, {residual.dtype}"
            )
        if residual_out is None:
            residual_out = torch.empty((t, h), device=x.device, dtype=x.dtype)
        if residual_out.shape != x.shape or residual_out.dtype != x.dtype:
            raise ValueError(f"rms_norm: residual_out must be {tuple(x.shape)} {x.dtype}")
        tensors += [("residual", residual), ("residual_out", residual_out)]
    elif residual_out is not None:
        raise ValueError("rms_norm: residual_out given without residual")
    if scale_out is not None:
        if out_dtype != x.dtype or scale_out.shape != (t, 1) or scale_out.dtype != torch.float32 \
                or scale_out.device != x.device:
            raise ValueError(f"rms_norm: scale_out must be float32 [{t}, 1] on {x.device}, and the output in x's "
                             f"dtype (x {x.dtype}, weight {weight.dtype})")
        out_dtype = FP8
    if out is None:
        out = torch.empty((t, h), device=x.device, dtype=out_dtype)
    if out.shape != x.shape or out.dtype != out_dtype:
        raise ValueError(f"rms_norm: out must be {tuple(x.shape)} {out_dtype}, got {tuple(out.shape)} {out.dtype}")
    if residual_out is not None and out.data_ptr() == residual_out.data_ptr():
        raise ValueError("rms_norm: out and residual_out must be different tensors")
    tensors.append(("out", out))
    for name, a in tensors:
        if a.stride(1) != 1 and h > 1:
            raise ValueError(f"rms_norm: {name} must be contiguous in H (strides {a.stride()})")
        if a.device != x.device:
            raise ValueError(f"rms_norm: {name} is on {a.device}, x on {x.device}")
    if t > 0:
        block = next_pow2(h)
        # without a residual its pointers and strides are None (constexprs to Triton: nothing to bind)
        has_res = residual is not None
        _rms_norm_kernel[(t,)](
            x, residual, weight, out, residual_out if has_res else None, pre_weight, scale_out,
            x.stride(0), residual.stride(0) if has_res else None, out.stride(0),
            residual_out.stride(0) if has_res else None,
            h, 1.0 / h, eps, 1.0 if x_scale is None else float(x_scale),  # (runtime arguments: positional,
            # as kernels/launch.py's fast path needs them)
            HAS_RES=residual is not None, BLOCK=block, LIBDEVICE=x.is_cuda, UNIT_OFFSET=unit_offset,
            PRE=pre_weight is not None, SCALE_X=x_scale is not None, QUANT=scale_out is not None,
            INV_MAX=INV_MAX, num_warps=num_warps or _num_warps(block), enable_fp_fusion=False,
        )
    return out if residual is None else (out, residual_out)


# ---- Qwen3's per-head q / k norm, in place in the QKV projection's output ----------------------------
@triton.jit
def _qk_norm_kernel(
    X, QW, KW, stride_t, num_q_heads, inv_d, eps,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    """One program per (token, head) of the q and k heads: the head's vector is normed in place with
    q_weight (heads < num_q_heads) or k_weight, with _rms_norm_kernel's arithmetic."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HEAD_DIM
    ptr = X + t * stride_t + h * HEAD_DIM + cols
    x = tl.load(ptr, mask=mask, other=0.0)
    w = tl.where(h < num_q_heads, tl.load(QW + cols, mask=mask, other=0.0), tl.load(KW + cols, mask=mask, other=0.0))
    tl.store(ptr, _normed(x, w, inv_d, eps, LIBDEVICE, UNIT_OFFSET).to(X.dtype.element_ty), mask=mask)


_qk_norm_kernel = fast_launch(_qk_norm_kernel)


def qk_rms_norm_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                    num_q_heads: int, num_kv_heads: int, head_dim: int, unit_offset: bool = False) -> torch.Tensor:
    """A new [T, (Hq + 2 Hkv) * D] tensor: qkv with each q head normed by q_weight and each k head by
    k_weight (rms_norm_ref over head_dim); v as it was."""
    t = qkv.shape[0]
    heads = qkv.reshape(t, num_q_heads + 2 * num_kv_heads, head_dim)
    q = rms_norm_ref(heads[:, :num_q_heads], q_weight, eps, unit_offset)
    k = rms_norm_ref(heads[:, num_q_heads:num_q_heads + num_kv_heads], k_weight, eps, unit_offset)
    return torch.cat([q, k, heads[:, num_q_heads + num_kv_heads:]], dim=1).reshape(qkv.shape)


def qk_rms_norm_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 num_q_heads: int, num_kv_heads: int, head_dim: int, unit_offset: bool = False) -> torch.Tensor:
    """In place: norm each q head of qkv [T, (Hq + 2 Hkv) * D] (rows may be strided, the rest
    contiguous) with q_weight [D] and each k head with k_weight [D], in one launch (instead of two
    copies out of the projection and two norms). The weights must have qkv's dtype (the product is
    rounded once, in that dtype). Returns qkv. No host synchronisation (CUDA-graph safe)."""
    if qkv.dim() != 2 or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qk_rms_norm_: qkv must be [T, {(num_q_heads + 2 * num_kv_heads) * head_dim}], "
                         f"got {tuple(qkv.shape)}")
    if qkv.dtype not in _DTYPES or qkv.stride(1) != 1:
        raise ValueError(f"qk_rms_norm_: qkv must be float16/bfloat16/float32 and contiguous per row, "
                         f"got {qkv.dtype} strides {qkv.stride()}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_dim,) or w.stride(0) != 1 or w.dtype != qkv.dtype or w.device != qkv.device:
            raise ValueError(f"qk_rms_norm_: {name} must be contiguous [{head_dim}] {qkv.dtype} on {qkv.device}, "
                             f"got {tuple(w.shape)} {w.dtype} on {w.device}")
    t = qkv.shape[0]
    if t > 0:
        block = next_pow2(head_dim)
        _qk_norm_kernel[(t, num_q_heads + num_kv_heads)](
            qkv, q_weight, k_weight, qkv.stride(0), num_q_heads, 1.0 / head_dim, eps,
            HEAD_DIM=head_dim, BLOCK=block, LIBDEVICE=qkv.is_cuda, UNIT_OFFSET=unit_offset,
            num_warps=1 if block <= 128 else 2,
            enable_fp_fusion=False,
        )
    return qkv
