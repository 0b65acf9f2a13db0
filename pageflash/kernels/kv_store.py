"""Write the new tokens' K/V into the paged KV cache (one Triton program per token).

Cache layout (see pageflash.layers.attention): ``[num_blocks, block_size, num_kv_heads, head_dim]``;
slot ``s`` is block ``s // block_size``, offset ``s % block_size``. A slot of -1 means "do not store"
(padding tokens, e.g. in a CUDA-graph-padded batch).

Quantized caches (int8 / float8_e4m3fn codes) get one float32 scale per (token, KV head) in
``k_scale`` / ``v_scale`` ``[num_blocks, num_kv_heads, block_size]``, computed here from the row
being stored (``quantize_kv_ref``'s arithmetic, operation for operation).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pageflash.kernels.host_math import next_pow2
from pageflash.kernels.launch import fast_launch
from pageflash.layers.attention import check_kv_scales, kv_code_max, store_kv_ref

__all__ = ["store_kv", "store_kv_ref"]


@triton.jit
def e4m3_round(y):
    """float32 y (|y| <= 448) rounded to the nearest float8 e4m3 value, ties to even, as float32 --
    so that the conversion to the code dtype is exact. (Triton's interpreter converts float32 to e4m3
    without carrying a round-up into the exponent: 124.3 became 64. On the GPU the conversion is
    right either way; doing it here keeps the two, and torch, equal.) Normal range: the 20 low
    mantissa bits rounded off in the integer domain; below 2**-6 (e4m3's subnormals) steps of 2**-9."""
    bits = y.to(tl.int32, bitcast=True)
    neg = bits < 0  # the sign bit (-0.0 included)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == 0xFFF00000
    normal = bits.to(tl.float32, bitcast=True)
    z = tl.abs(y) * 512.0
    r = tl.floor(z + 0.5)
    r = tl.where((r - z == 0.5) & (r - 2.0 * tl.floor(r * 0.5) != 0.0), r - 1.0, r) / 512.0
    return tl.where(tl.abs(y) < 0.015625, tl.where(neg, -r, r), normal)


@triton.jit
def kv_round(y, QMAX: tl.constexpr, CODE_INT: tl.constexpr):
    """y = x / scale (|y| <= QMAX) as the value its code holds: int8 rounds half up and clamps,
    e4m3 rounds to nearest even (``e4m3_round``); the conversion to the code dtype is then exact."""
    if CODE_INT:
        y = tl.minimum(tl.maximum(tl.floor(y + 0.5), -QMAX), QMAX)
    else:
        y = e4m3_round(y)
    return y


@triton.jit
def store_quantized_row(x, dst, scale_dst, mask, scale_mask, QMAX: tl.constexpr, CODE_INT: tl.constexpr):
    """One row x [C] (masked entries 0) quantized with one scale: codes to dst (pointers [C]), the
    scale to scale_dst; returns what the cache now reads back (code x scale, float32)."""
    xf = x.to(tl.float32)
    s = tl.max(tl.abs(xf), 0) / QMAX
    q = kv_round(xf / tl.where(s > 0.0, s, 1.0), QMAX, CODE_INT).to(dst.dtype.element_ty)
    tl.store(dst, q, mask=mask)
    tl.store(scale_dst, s, mask=scale_mask)
    return q.to(tl.float32) * s


@triton.jit
def store_quantized_rows(x, dst, scale_dst, mask, row_mask, QMAX: tl.constexpr, CODE_INT: tl.constexpr):
    """Quantize the rows of x [R, C] (masked entries 0) with one scale each: codes to dst [R, C]
    (pointers), scales to scale_dst [R]."""
    xf = x.to(tl.float32)
    s = tl.max(tl.abs(xf), 1) / QMAX
    y = kv_round(xf / tl.where(s > 0.0, s, 1.0)[:, None], QMAX, CODE_INT)
    tl.store(dst, y.to(dst.dtype.element_ty), mask=mask)
    tl.store(scale_dst, s, mask=row_mask)


@triton.jit
def slot_page(SLOTS, t, PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Token t's slot as (block, offset in the block, keep [ROWS, COLS]); slot -1 keeps nothing."""
    slot = tl.load(SLOTS + t).to(tl.int64)
    blk = tl.maximum(slot, 0) // PAGE_SIZE
    off = tl.maximum(slot, 0) % PAGE_SIZE
    # (the slot is broadcast before the comparison: the interpreter rejects scalar-bool & block-bool)
    keep = (tl.zeros([ROWS, COLS], dtype=tl.int64) + slot) >= 0
    return blk, off, keep


@triton.jit
def _store_kv_kernel(
    K, V, KC, VC, SLOTS,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    KS, VS, stride_sb, stride_sh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr = False, QMAX: tl.constexpr = 1.0, CODE_INT: tl.constexpr = False,
):
    t = tl.program_id(0).to(tl.int64)
    blk, off, keep = slot_page(SLOTS, t, PAGE_SIZE, BLOCK_H, BLOCK_D)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = keep & (h[:, None] < NUM_HEADS) & (d[None, :] < HEAD_DIM)
    k = tl.load(K + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask, other=0.0)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask, other=0.0)
    kc = KC + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
    vc = VC + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
    if QUANT:
        s_off = blk * stride_sb + h * stride_sh + off
        row_mask = tl.max(mask.to(tl.int32), 1) > 0
        store_quantized_rows(k, kc, KS + s_off, mask, row_mask, QMAX, CODE_INT)
        store_quantized_rows(v, vc, VS + s_off, mask, row_mask, QMAX, CODE_INT)
    else:
        tl.store(kc, k.to(KC.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(VC.dtype.element_ty), mask=mask)


_store_kv_kernel = fast_launch(_store_kv_kernel)  # host launches via the cached CompiledKernel


def kv_scale_args(k_cache: torch.Tensor, v_cache: torch.Tensor,
                  kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]], who: str) -> tuple:
    """check_kv_scales, then the kernels' arguments (KS, VS, stride_sb, stride_sh) and constexprs
    (QUANT, QMAX, CODE_INT)."""
    check_kv_scales(k_cache, v_cache, kv_scales, who)
    if kv_scales is None:
        return (None, None, 0, 0), dict(QUANT=False, QMAX=1.0, CODE_INT=False)
    ks, vs = kv_scales
    return (ks, vs, ks.stride(0), ks.stride(1)), dict(
        QUANT=True, QMAX=kv_code_max(k_cache.dtype), CODE_INT=k_cache.dtype == torch.int8)


def check_store_args(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Shapes, dtypes and strides store_kv (and the rotary kernel's fused store) accept."""
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"store_kv: k and v must both be [T, Hkv, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(
            f"store_kv: caches must both be [num_blocks, block_size, Hkv, D], got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    t, h, d = k.shape
    if k_cache.shape[2:] != (h, d):
        raise ValueError(f"store_kv: cache heads/head_dim {tuple(k_cache.shape[2:])} != k's {(h, d)}")
    if slot_mapping.shape != (t,):
        raise ValueError(f"store_kv: slot_mapping must be [{t}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"store_kv: slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    for name, x in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"store_kv: {name} must be contiguous in head_dim (stride {x.stride(-1)})")


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> None:
    """Write k, v ([T, Hkv, D]) into k_cache, v_cache ([num_blocks, block_size, Hkv, D]) at
    slot_mapping ([T] int32/int64, -1 = skip); into a quantized cache with kv_scales (k_scale,
    v_scale [num_blocks, Hkv, block_size] float32). In place; no host synchronisation."""
    check_store_args(k, v, k_cache, v_cache, slot_mapping)
    qargs, qconst = kv_scale_args(k_cache, v_cache, kv_scales, "store_kv")
    t, h, d = k.shape
    if t == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), *qargs,
        NUM_HEADS=h, HEAD_DIM=d, **qconst,
        BLOCK_H=next_pow2(h), BLOCK_D=next_pow2(d), PAGE_SIZE=k_cache.shape[1],
        num_warps=4 if h * d >= 2048 else 2,
    )
