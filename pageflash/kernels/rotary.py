"""Rotary position embedding (HF/NeoX rotate-halves layout) on q and k in place, in one Triton launch.

The arithmetic is ``pageflash.layers.rotary._rotate``'s, operation for operation, each result rounded
to the tensor's dtype as PyTorch's eager kernels round it:

    c, s = cos[row].to(dtype), sin[row].to(dtype)
    out1 = x1 * c - x2 * s          (x1 = x[..., :R/2], x2 = x[..., R/2:R])
    out2 = x2 * c + x1 * s

(the products of 16-bit operands are exact in float32; FMA contraction is disabled), so the result is
bitwise equal to the reference on CUDA. R, the rotary dim, is twice the tables' width: D, or less for
partial rotary embeddings (Phi-4-mini), whose dims R.. are left as they are (and stored as they are
by the fused K/V store).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from pageflash.kernels.host_math import cdiv, next_pow2
from pageflash.kernels.kv_store import check_store_args, kv_round, kv_scale_args, slot_page
from pageflash.kernels.launch import fast_launch
from pageflash.layers.rotary import _rotate

__all__ = ["apply_rotary", "apply_rotary_ref"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(base, stride_h, num_heads, h0, c, s,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rotate heads [h0, h0 + BLOCK_H) of one token; base points at its head 0. c, s: [BLOCK_HALF] fp32.
    Returns the rotated halves (in base's dtype) for callers that also store them elsewhere."""
    dt = base.dtype.element_ty
    h = h0 + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h[:, None] < num_heads) & (d[None, :] < HALF)
    p1 = base + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    c = c.to(dt).to(tl.float32)[None, :]
    s = s.to(dt).to(tl.float32)[None, :]
    o1 = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
    o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + HALF, o2, mask=mask)
    return o1, o2


@triton.jit
def _store_parts_q(x1, x2, x3, dst, dst3, scale_dst, mask, mask3, row_mask, HALF: tl.constexpr,
                   PASS: tl.constexpr, QMAX: tl.constexpr, CODE_INT: tl.constexpr):
    """Quantize rows given as parts with one scale per row: the rotary halves x1, x2 [R, BLOCK_HALF]
    (dims [0, HALF) and [HALF, 2 HALF): codes to dst, dst + HALF) and, when PASS > 0, the
    pass-through dims x3 [R, BLOCK_PASS] (codes to dst3); masked entries 0. Scales to scale_dst [R]."""
    f1 = x1.to(tl.float32)
    f2 = x2.to(tl.float32)
    m = tl.maximum(tl.max(tl.abs(f1), 1), tl.max(tl.abs(f2), 1))
    if PASS > 0:
        f3 = x3.to(tl.float32)
        m = tl.maximum(m, tl.max(tl.abs(f3), 1))
    s = m / QMAX
    den = tl.where(s > 0.0, s, 1.0)[:, None]
    tl.store(dst, kv_round(f1 / den, QMAX, CODE_INT).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, kv_round(f2 / den, QMAX, CODE_INT).to(dst.dtype.element_ty), mask=mask)
    if PASS > 0:
        tl.store(dst3, kv_round(f3 / den, QMAX, CODE_INT).to(dst3.dtype.element_ty), mask=mask3)
    tl.store(scale_dst, s, mask=row_mask)


@triton.jit
def _rotary_kernel(
    Q, K, POS, COS, SIN,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    HQ, HKV,
    V, KC, VC, SLOTS, stride_vt, stride_vh, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    KS, VS, stride_sb, stride_sh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    STORE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    QUANT: tl.constexpr = False, QMAX: tl.constexpr = 1.0, CODE_INT: tl.constexpr = False,
    PASS: tl.constexpr = 0, BLOCK_PASS: tl.constexpr = 1,
):
    # grid (T, cdiv(HQ, BLOCK_H) + cdiv(HKV, BLOCK_H)): a program owns BLOCK_H heads of q or of k
    # STORE: the k programs also write their rotated k heads and the same v heads into the paged
    # cache at the token's slot (-1: skip), with kernels/kv_store.py's slot arithmetic
    # PASS: partial rotary embeddings' dims [2 HALF, 2 HALF + PASS) of each head, which do not rotate:
    # only the store reads them (from k, which this launch does not write there)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(POS + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    c = tl.load(COS + pos * stride_cos + d, mask=d < HALF, other=0.0)
    s = tl.load(SIN + pos * stride_sin + d, mask=d < HALF, other=0.0)
    nqb = tl.cdiv(HQ, BLOCK_H)
    if hb < nqb:
        _rotate_heads(Q + t * stride_qt, stride_qh, HQ, hb * BLOCK_H, c, s, HALF, BLOCK_H, BLOCK_HALF)
    else:
        h0 = (hb - nqb) * BLOCK_H
        o1, o2 = _rotate_heads(K + t * stride_kt, stride_kh, HKV, h0, c, s, HALF, BLOCK_H, BLOCK_HALF)
        if STORE:
            blk, off, keep = slot_page(SLOTS, t, PAGE_SIZE, BLOCK_H, BLOCK_HALF)
            h = h0 + tl.arange(0, BLOCK_H)
            mask = keep & (h[:, None] < HKV) & (d[None, :] < HALF)
            kc = KC + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + d[None, :]
            pv = V + t * stride_vt + h[:, None] * stride_vh + d[None, :]
            vc = VC + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + d[None, :]
            k3, v3, mask3, kc3, vc3 = o1, o1, mask, kc, vc  # (placeholders where PASS == 0)
            if PASS > 0:
                e = tl.arange(0, BLOCK_PASS)
                _, _, keep3 = slot_page(SLOTS, t, PAGE_SIZE, BLOCK_H, BLOCK_PASS)
                mask3 = keep3 & (h[:, None] < HKV) & (e[None, :] < PASS)
                k3 = tl.load(K + t * stride_kt + h[:, None] * stride_kh + 2 * HALF + e[None, :], mask=mask3, other=0.0)
                v3 = tl.load(V + t * stride_vt + h[:, None] * stride_vh + 2 * HALF + e[None, :], mask=mask3, other=0.0)
                kc3 = KC + blk * stride_kcb + off * stride_kcs + h[:, None] * stride_kch + 2 * HALF + e[None, :]
                vc3 = VC + blk * stride_vcb + off * stride_vcs + h[:, None] * stride_vch + 2 * HALF + e[None, :]
            if QUANT:
                # one scale per (token, head) over the whole head: kv_store.store_quantized_rows' arithmetic
                row_mask = (h < HKV) & (tl.max(keep.to(tl.int32), 1) > 0)
                s_off = blk * stride_sb + h * stride_sh + off
                _store_parts_q(o1, o2, k3, kc, kc3, KS + s_off, mask, mask3, row_mask, HALF, PASS, QMAX, CODE_INT)
                v1 = tl.load(pv, mask=mask, other=0.0)
                v2 = tl.load(pv + HALF, mask=mask, other=0.0)
                _store_parts_q(v1, v2, v3, vc, vc3, VS + s_off, mask, mask3, row_mask, HALF, PASS, QMAX, CODE_INT)
            else:
                tl.store(kc, o1.to(KC.dtype.element_ty), mask=mask)
                tl.store(kc + HALF, o2.to(KC.dtype.element_ty), mask=mask)
                tl.store(vc, tl.load(pv, mask=mask).to(VC.dtype.element_ty), mask=mask)
                tl.store(vc + HALF, tl.load(pv + HALF, mask=mask).to(VC.dtype.element_ty), mask=mask)
                if PASS > 0:
                    tl.store(kc3, k3.to(KC.dtype.element_ty), mask=mask3)
                    tl.store(vc3, v3.to(VC.dtype.element_ty), mask=mask3)


_rotary_kernel = fast_launch(_rotary_kernel)  # host launches via the cached CompiledKernel


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place reference: the PyTorch path of RotaryEmbedding.forward."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def rotary_config(num_tokens: int, head_dim: int, max_heads: int) -> tuple[int, int]:
    """(BLOCK_H, num_warps). Few tokens: small head blocks, so a decode step still spreads over
    several SMs; many tokens: ~1K elements of q or k per program."""
    block_h = 2 if num_tokens <= 16 else max(1, 1024 // head_dim)
    block_h = min(block_h, next_pow2(max_heads))
    return block_h, 4


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    v: Optional[torch.Tensor] = None, k_cache: Optional[torch.Tensor] = None, v_cache: Optional[torch.Tensor] = None,
    slot_mapping: Optional[torch.Tensor] = None, kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (and return them) by the table rows positions [T]
    (int64/int32; RotaryEmbedding.rows).

    cos, sin: [P, R/2] float32 tables (row stride free, last dim contiguous), R <= D even: the first R
    dims of each head rotate (R < D: partial rotary embeddings; the rest stay). q and k: same dtype
    (float16/bfloat16/float32), any token/head strides with D contiguous, e.g. views of a fused qkv
    projection's output. Positions must be in [0, P) (not checked: that would sync with the host).

    With v, k_cache, v_cache and slot_mapping (all or none), the same launch also writes the rotated
    k and v into the paged caches, exactly as ``store_kv(k, v, k_cache, v_cache, slot_mapping)``
    would after the rotation (the decode step's separate store launch goes away); kv_scales: a
    quantized cache's scales, as store_kv takes them.
    """
    given = [a is not None for a in (v, k_cache, v_cache, slot_mapping)]
    store = all(given)
    if any(given) and not store:
        raise ValueError("apply_rotary: v, k_cache, v_cache and slot_mapping go together")
    if store:
        check_store_args(k, v, k_cache, v_cache, slot_mapping)
        qargs, qconst = kv_scale_args(k_cache, v_cache, kv_scales, "apply_rotary")
    elif kv_scales is not None:
        raise ValueError("apply_rotary: kv_scales go with k_cache and v_cache")
    else:
        qargs, qconst = (None, None, 0, 0), {}
    if q.dim() != 3 or k.dim() != 3:
        raise ValueError(f"apply_rotary: q and k must be [T, H, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    t, hq, d = q.shape
    if k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"apply_rotary: k {tuple(k.shape)} does not match q {tuple(q.shape)} in T or D")

    if q.dtype != k.dtype or q.dtype not in _DTYPES:
        raise TypeError(f"apply_rotary: q and k must share a float16/bfloat16/float32 dtype, got {q.dtype}/{k.dtype}")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"apply_rotary: positions must be [{t}] int32/int64, got {tuple(positions.shape)} {positions.dtype}")
    for name, tab in (("cos", cos), ("sin", sin)):
        if tab.dim() != 2 or not 1 <= tab.shape[1] <= d // 2 or tab.dtype != torch.float32 or tab.stride(1) != 1:
            raise ValueError(
                f"apply_rotary: {name} must be float32 [P, R/2] with R <= head_dim ({d}), contiguous in the last "
                f"dim, got {tuple(tab.shape)} {tab.dtype} strides {tab.stride()}"
            )
    half = cos.shape[1]
    if sin.shape[1] != half:
        raise ValueError(f"apply_rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in width")
    for name, x in (("q", q), ("k", k)):
        if x.stride(2) != 1:
            raise ValueError(f"apply_rotary: {name} must be contiguous in head_dim (strides {x.stride()})")
    for name, x in (("k", k), ("positions", positions), ("cos", cos), ("sin", sin)):
        if x.device != q.device:
            raise ValueError(f"apply_rotary: {name} is on {x.device}, q on {q.device}")
    hkv = k.shape[1]
    if t == 0:
        return q, k
    positions = positions.contiguous()
    block_h, num_warps = rotary_config(t, d, max(hq, hkv))
    grid = (t, cdiv(hq, block_h) + cdiv(hkv, block_h))
    if store:
        slots = slot_mapping.contiguous()
        kc_st, vc_st = k_cache.stride(), v_cache.stride()
        extra = (v, k_cache, v_cache, slots, v.stride(0), v.stride(1), kc_st[0], kc_st[1], kc_st[2],
                 vc_st[0], vc_st[1], vc_st[2])
    else:  # unused with STORE off: None arguments are constexprs to Triton (nothing to bind per launch)
        extra = (None,) * 12
    _rotary_kernel[grid](
        q, k, positions, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        hq, hkv, *extra, *qargs, **qconst,
        HALF=half, BLOCK_H=block_h, BLOCK_HALF=next_pow2(half),
        STORE=store, PAGE_SIZE=k_cache.shape[1] if store else 1,
        PASS=d - 2 * half if store else 0, BLOCK_PASS=next_pow2(max(1, d - 2 * half)),
        num_warps=num_warps, enable_fp_fusion=False,
    )
    return q, k
