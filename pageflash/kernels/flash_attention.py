"""FlashAttention-2 forward and backward in Triton, for contiguous (non-paged) batches.

Two layouts share the same kernels:

- varlen: q ``[Tq_total, Hq, D]``, k/v ``[T_total, Hkv, D]``, ``cu_seqlens`` int32 ``[B + 1]`` (sequence
  ``b`` is rows ``cu_seqlens[b]:cu_seqlens[b+1]`` of q, k and v; same lengths for q and k/v);
- batched: q ``[B, Hq, N, D]``, k/v ``[B, Hkv, N, D]`` (torch SDPA's layout), any strides with the
  last dimension contiguous.

GQA/MQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``; K/V are never repeated.

Forward (FA2): one program per (query block of BLOCK_M rows, query head, sequence); it streams key
blocks of BLOCK_N rows through an online softmax (running max ``m``, running sum ``l``, in base 2 with
``scale * log2(e)`` folded into the scores) and writes O and one log-sum-exp per query row (natural
log) for the backward. Causal: query blocks are launched heaviest first; the keys left of the block
diagonal run without masks, the diagonal block with the mask.

Backward (FA2, atomic-free): ``delta = rowsum(dO * O)``; one kernel per (key block, KV head,
sequence) accumulates dK and dV over every query head of the KV group and every query block (P is
recomputed from Q, K and the saved LSE); a second kernel per (query block, query head, sequence)
accumulates dQ over the key blocks.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl

from pageflash.kernels.host_math import cdiv, next_pow2
from pageflash.kernels.launch import fast_launch
from pageflash.layers.attention import soft_cap

__all__ = [
    "flash_attention",
    "flash_attention_ref",
    "flash_attn_varlen",
    "flash_attn_varlen_fwd",
    "flash_attn_varlen_ref",
    "fwd_config",
    "bwd_config",
]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(base, rows, row_stride, offs_d, row_limit,
               ROW_MASK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Load a [len(rows), BLOCK_D] tile; masks only what the constexprs say can be out of range."""
    ptrs = base + rows[:, None] * row_stride + offs_d[None, :]
    if ROW_MASK:
        if BLOCK_D != HEAD_DIM:
            return tl.load(ptrs, mask=(rows[:, None] < row_limit) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        else:
            return tl.load(ptrs, mask=rows[:, None] < row_limit, other=0.0)
    else:
        if BLOCK_D != HEAD_DIM:
            return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def scale_scores(qk, qk_scale, SOFTCAP: tl.constexpr):
    """qk * qk_scale (scale * log2(e): the kernels' exp2 domain), softcapped when SOFTCAP > 0 (Gemma 2:
    c * tanh(s / c) of the score s = scale * q . k; SOFTCAP = c * log2(e), the cap in the same domain).
    tanh(y) = 1 - 2 / (exp(2y) + 1): exact at both saturated ends, no libdevice (the interpreter too)."""
    x = qk * qk_scale
    if SOFTCAP > 0:
        e = tl.math.exp2(x * (2.0 * 1.4426950408889634 / SOFTCAP))
        x = SOFTCAP - (2.0 * SOFTCAP) / (e + 1.0)
    return x


def softcap_arg(softcap: Optional[float]) -> float:
    """The kernels' SOFTCAP constexpr for a layer's attention softcap (None: 0.0, none)."""
    if softcap is None:
        return 0.0
    if not softcap > 0:
        raise ValueError(f"attention softcap must be positive, got {softcap!r}")
    return float(softcap) * LOG2E


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, hi, seqlen, qk_scale,
               offs_m, offs_n, offs_d,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_N: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load_rows(k_base, cols, stride_kt, offs_d, seqlen, MASKED, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if MASKED:
            ok = cols[None, :] < seqlen
            if CAUSAL:
                ok = ok & (offs_m[:, None] >= cols[None, :])
            if WINDOW > 0:  # sliding window: row i sees keys i - WINDOW + 1 .. i
                ok = ok & (cols[None, :] > offs_m[:, None] - WINDOW)
            qk = tl.where(ok, scale_scores(qk, qk_scale, SOFTCAP), float("-inf"))
        else:
            qk = scale_scores(qk, qk_scale, SOFTCAP)
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_rows(v_base, cols, stride_vt, offs_d, seqlen, MASKED, HEAD_DIM, BLOCK_D)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, CU_SEQLENS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lh,
    seqlen_static, qk_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0,
):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the heaviest query blocks first: better tail balance
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    if VARLEN:
        start = tl.load(CU_SEQLENS + b)
        seqlen = tl.load(CU_SEQLENS + b + 1) - start
    else:
        start = b * 0
        seqlen = seqlen_static
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen:
        return
    hk = h // GROUP
    b64 = b.to(tl.int64)
    s64 = start.to(tl.int64)
    q_base = Q + b64 * stride_qb + s64 * stride_qt + h * stride_qh
    k_base = K + b64 * stride_kb + s64 * stride_kt + hk * stride_kh
    v_base = V + b64 * stride_vb + s64 * stride_vt + hk * stride_vh
    o_base = O + b64 * stride_ob + s64 * stride_ot + h * stride_oh

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_base, offs_m, stride_qt, offs_d, seqlen, True, HEAD_DIM, BLOCK_D)
    # finite start: a row whose first tile is fully masked gets p = 0, alpha = 1 (no inf - inf)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL and WINDOW > 0:
        # sliding window (causal only): keys before lo are out of every row's window; keys in
        # [lo, edge) out of some rows' (masked), [edge, m0) in every row's (unmasked); then the diagonal
        lo = tl.maximum(m0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        edge = tl.minimum(tl.cdiv(tl.maximum(m0 + BLOCK_M - WINDOW, 0), BLOCK_N) * BLOCK_N, m0)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, lo, edge, seqlen,
                                   qk_scale, offs_m, offs_n, offs_d,
                                   True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC, WINDOW, SOFTCAP)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, tl.maximum(edge, lo), m0,
                                   seqlen, qk_scale, offs_m, offs_n, offs_d,
                                   False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC, 0, SOFTCAP)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, m0,
                                   tl.minimum(m0 + BLOCK_M, seqlen), seqlen, qk_scale, offs_m, offs_n, offs_d,
                                   True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC, WINDOW, SOFTCAP)
    elif CAUSAL:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, 0, m0, seqlen,
                                   qk_scale, offs_m, offs_n, offs_d,
                                   False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC, 0, SOFTCAP)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, m0,
                                   tl.minimum(m0 + BLOCK_M, seqlen), seqlen, qk_scale, offs_m, offs_n, offs_d,
                                   True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC, 0, SOFTCAP)
    else:
        full = seqlen - seqlen % BLOCK_N
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, 0, full, seqlen,
                                   qk_scale, offs_m, offs_n, offs_d,
                                   False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC, 0, SOFTCAP)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, full, seqlen, seqlen,
                                   qk_scale, offs_m, offs_n, offs_d,
                                   True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC, 0, SOFTCAP)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    acc = acc / l_safe[:, None]
    row_ok = offs_m < seqlen
    o_ptrs = o_base + offs_m[:, None] * stride_ot + offs_d[None, :]
    if BLOCK_D != HEAD_DIM:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))
    else:
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453
    tl.store(LSE + b64 * stride_lb + h * stride_lh + s64 + offs_m, lse, mask=row_ok)


_fwd_kernel = fast_launch(_fwd_kernel)  # host launches via the cached CompiledKernel


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA, CU_SEQLENS,
    stride_ob, stride_ot, stride_oh,
    stride_db, stride_dt, stride_dh,
    stride_lb, stride_lh,
    seqlen_static,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, VARLEN: tl.constexpr,
):
    """delta[row] = sum_d dO[row, d] * O[row, d] (fp32), stored in the LSE layout."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    if VARLEN:
        start = tl.load(CU_SEQLENS + b)
        seqlen = tl.load(CU_SEQLENS + b + 1) - start
    else:
        start = b * 0
        seqlen = seqlen_static
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen:
        return
    b64 = b.to(tl.int64)
    s64 = start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(O + b64 * stride_ob + s64 * stride_ot + h * stride_oh, offs_m, stride_ot, offs_d, seqlen,
                   True, HEAD_DIM, BLOCK_D)
    do = _load_rows(DO + b64 * stride_db + s64 * stride_dt + h * stride_dh, offs_m, stride_dt, offs_d, seqlen,
                    True, HEAD_DIM, BLOCK_D)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + b64 * stride_lb + h * stride_lh + s64 + offs_m, delta, mask=offs_m < seqlen)


_bwd_preprocess_kernel = fast_launch(_bwd_preprocess_kernel)  # host launches via the cached CompiledKernel


@triton.jit
def _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dt,
                    lo, hi, seqlen, qk_scale, offs_n, offs_d,
                    MASKED: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, PREC: tl.constexpr):
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < seqlen
        q = _load_rows(q_base, offs_m, stride_qt, offs_d, seqlen, True, HEAD_DIM, BLOCK_D)
        # rows past the end: lse = +inf -> p = 0, no contribution
        lse2 = tl.load(lse_base + offs_m, mask=row_ok, other=float("inf")) * 1.4426950408889634
        qkT = tl.dot(k, tl.trans(q), input_precision=PREC)  # [BLOCK_N, BLOCK_M]
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if MASKED:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        do = _load_rows(do_base, offs_m, stride_dt, offs_d, seqlen, True, HEAD_DIM, BLOCK_D)
        dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PREC)
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        dpT = tl.dot(v, tl.trans(do), input_precision=PREC)
        dsT = pT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(q.dtype), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, CU_SEQLENS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_db, stride_dt, stride_dh,
    stride_dkb, stride_dkt, stride_dkh,
    stride_dvb, stride_dvt, stride_dvh,
    stride_lb, stride_lh,
    seqlen_static, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """One program: BLOCK_N keys of one KV head; sums over the GROUP query heads (no atomics)."""
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    if VARLEN:
        start = tl.load(CU_SEQLENS + b)
        seqlen = tl.load(CU_SEQLENS + b + 1) - start
    else:
        start = b * 0
        seqlen = seqlen_static
    n0 = pid_n * BLOCK_N
    if n0 >= seqlen:
        return
    b64 = b.to(tl.int64)
    s64 = start.to(tl.int64)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + b64 * stride_kb + s64 * stride_kt + hk * stride_kh, offs_n, stride_kt, offs_d, seqlen,
                   True, HEAD_DIM, BLOCK_D)
    v = _load_rows(V + b64 * stride_vb + s64 * stride_vt + hk * stride_vh, offs_n, stride_vt, offs_d, seqlen,
                   True, HEAD_DIM, BLOCK_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + b64 * stride_qb + s64 * stride_qt + h * stride_qh
        do_base = DO + b64 * stride_db + s64 * stride_dt + h * stride_dh
        lse_base = LSE + b64 * stride_lb + h * stride_lh + s64
        delta_base = DELTA + b64 * stride_lb + h * stride_lh + s64
        if CAUSAL:
            mid = tl.minimum(n0 + BLOCK_N, seqlen)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dt,
                                     n0, mid, seqlen, qk_scale, offs_n, offs_d,
                                     True, HEAD_DIM, BLOCK_D, BLOCK_M, PREC)
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dt,
                                     n0 + BLOCK_N, seqlen, seqlen, qk_scale, offs_n, offs_d,
                                     False, HEAD_DIM, BLOCK_D, BLOCK_M, PREC)
        else:
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qt, stride_dt,
                                     0, seqlen, seqlen, qk_scale, offs_n, offs_d,
                                     False, HEAD_DIM, BLOCK_D, BLOCK_M, PREC)
    dk = dk * sm_scale
    row_ok = offs_n[:, None] < seqlen
    if BLOCK_D != HEAD_DIM:
        row_ok = row_ok & (offs_d[None, :] < HEAD_DIM)
    tl.store(DK + b64 * stride_dkb + s64 * stride_dkt + hk * stride_dkh + offs_n[:, None] * stride_dkt
             + offs_d[None, :], dk.to(DK.dtype.element_ty), mask=row_ok)
    tl.store(DV + b64 * stride_dvb + s64 * stride_dvt + hk * stride_dvh + offs_n[:, None] * stride_dvt
             + offs_d[None, :], dv.to(DV.dtype.element_ty), mask=row_ok)


_bwd_dkdv_kernel = fast_launch(_bwd_dkdv_kernel)  # host launches via the cached CompiledKernel


@triton.jit
def _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, lo, hi, seqlen, qk_scale,
                  offs_m, offs_d,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, PREC: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_rows(k_base, cols, stride_kt, offs_d, seqlen, MASKED, HEAD_DIM, BLOCK_D)
        v = _load_rows(v_base, cols, stride_vt, offs_d, seqlen, MASKED, HEAD_DIM, BLOCK_D)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            ok = cols[None, :] < seqlen
            if CAUSAL:
                ok = ok & (offs_m[:, None] >= cols[None, :])
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, CU_SEQLENS,
    stride_qb, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_db, stride_dt, stride_dh,
    stride_dqb, stride_dqt, stride_dqh,
    stride_lb, stride_lh,
    seqlen_static, qk_scale, sm_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, PREC: tl.constexpr,
):
    """One program: BLOCK_M query rows of one query head; loops over key blocks."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    if VARLEN:
        start = tl.load(CU_SEQLENS + b)
        seqlen = tl.load(CU_SEQLENS + b + 1) - start
    else:
        start = b * 0
        seqlen = seqlen_static
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen:
        return
    hk = h // GROUP
    b64 = b.to(tl.int64)
    s64 = start.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_m < seqlen
    q = _load_rows(Q + b64 * stride_qb + s64 * stride_qt + h * stride_qh, offs_m, stride_qt, offs_d, seqlen,
                   True, HEAD_DIM, BLOCK_D)
    do = _load_rows(DO + b64 * stride_db + s64 * stride_dt + h * stride_dh, offs_m, stride_dt, offs_d, seqlen,
                    True, HEAD_DIM, BLOCK_D)
    lse2 = tl.load(LSE + b64 * stride_lb + h * stride_lh + s64 + offs_m, mask=row_ok, other=float("inf"))
    lse2 = lse2 * 1.4426950408889634
    delta = tl.load(DELTA + b64 * stride_lb + h * stride_lh + s64 + offs_m, mask=row_ok, other=0.0)
    k_base = K + b64 * stride_kb + s64 * stride_kt + hk * stride_kh
    v_base = V + b64 * stride_vb + s64 * stride_vt + hk * stride_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if CAUSAL:
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, 0, m0, seqlen, qk_scale,
                           offs_m, offs_d, False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, m0,
                           tl.minimum(m0 + BLOCK_M, seqlen), seqlen, qk_scale,
                           offs_m, offs_d, True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC)
    else:
        full = seqlen - seqlen % BLOCK_N
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, 0, full, seqlen,
                           qk_scale, offs_m, offs_d, False, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC)
        dq = _bwd_dq_inner(dq, q, do, lse2, delta, k_base, v_base, stride_kt, stride_vt, full, seqlen, seqlen,
                           qk_scale, offs_m, offs_d, True, CAUSAL, HEAD_DIM, BLOCK_D, BLOCK_N, PREC)
    dq = dq * sm_scale
    mask = row_ok[:, None]
    if BLOCK_D != HEAD_DIM:
        mask = mask & (offs_d[None, :] < HEAD_DIM)
    tl.store(DQ + b64 * stride_dqb + s64 * stride_dqt + h * stride_dqh + offs_m[:, None] * stride_dqt
             + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------
# configs (static heuristics; tuned on H100 with pageflash.bench.kernels --sweep)
# ----------------------------------------------------------------------------------------------


_bwd_dq_kernel = fast_launch(_bwd_dq_kernel)  # host launches via the cached CompiledKernel


def fwd_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """BLOCK_M, BLOCK_N, num_warps, num_stages of the forward kernel (BLOCK_M % BLOCK_N == 0)."""
    if device.type != "cuda":  # interpreter: small tiles keep the tests fast and cross block borders
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    d = next_pow2(head_dim)
    if dtype == torch.float32:
        if d <= 64:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)
        if d <= 128:
            return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1)
        return dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
    if d <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    if d <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
    # head_dim 256 (Gemma): 128x64 tiles on 8 warps, 2 stages (H100, scripts/d256_probe.py: 489 / 448
    # TFLOP/s on gemma-2-9b / gemma-3-4b heads against 388 / 362 for 64x32 w4 s2; SDPA's FA2 295 / 281).
    # They need 192 KiB of shared memory on Hopper: GPUs with less (A100, sm86/89, consumer Blackwell)
    # keep 64x32 w4 s2 (68 KiB)
    if has_large_smem(device):
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2)


LARGE_SMEM = 200 * 1024  # bytes of shared memory per block the head_dim-256 tiles want (H100: 227 KiB)


@functools.lru_cache(maxsize=None)
def _max_shared_mem(index: int) -> int:
    try:
        return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 (another driver layout): compute capability 9.x / 10.0 have 227 KiB
        major, minor = torch.cuda.get_device_capability(index)
        return 227 * 1024 if major == 9 or (major, minor) == (10, 0) else 96 * 1024


def has_large_smem(device: torch.device) -> bool:
    """Whether device's blocks may take LARGE_SMEM bytes of shared memory (the head_dim-256 tiles)."""
    return device.type == "cuda" and _max_shared_mem(device.index if device.index is not None
                                                     else torch.cuda.current_device()) >= LARGE_SMEM


def bwd_config(head_dim: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Blocks of the dK/dV kernel (BLOCK_M1 x BLOCK_N1) and the dQ kernel (BLOCK_M2 x BLOCK_N2)."""
    if device.type != "cuda":
        return dict(BLOCK_M1=16, BLOCK_N1=16, BLOCK_M2=16, BLOCK_N2=16, num_warps=4, num_stages=1)
    d = next_pow2(head_dim)
    if dtype == torch.float32 or d > 128:
        return dict(BLOCK_M1=16, BLOCK_N1=32, BLOCK_M2=32, BLOCK_N2=16, num_warps=4, num_stages=1)
    if d <= 64:
        return dict(BLOCK_M1=32, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=32, num_warps=4, num_stages=3)
    return dict(BLOCK_M1=64, BLOCK_N1=128, BLOCK_M2=128, BLOCK_N2=64, num_warps=8, num_stages=3)


# ----------------------------------------------------------------------------------------------
# launchers
# ----------------------------------------------------------------------------------------------


def _strides(x: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides; varlen tensors are [T, H, D], batched ones [B, H, N, D]."""
    if varlen:
        return 0, x.stride(0), x.stride(1)
    return x.stride(0), x.stride(2), x.stride(1)


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """Returns (Hq, Hkv, D, N or T) after validating shapes, dtypes and strides."""
    nd = 3 if varlen else 4
    layout = "[T, H, D]" if varlen else "[B, H, N, D]"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != nd:
            raise ValueError(f"flash attention: {name} must be {layout}, got shape {tuple(x.shape)}")
        if x.stride(-1) != 1:
            raise ValueError(f"flash attention: {name} must be contiguous in head_dim (stride {x.stride(-1)})")
        if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"flash attention: {name} must be fp16/bf16/fp32, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"flash attention: q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"flash attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ")
    hq, hkv, d = (q.shape[1], k.shape[1], q.shape[-1])
    if k.shape[-1] != d:
        raise ValueError(f"flash attention: head_dim of q ({d}) and k ({k.shape[-1]}) differ")
    if hq % hkv:
        raise ValueError(f"flash attention: query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if d > 256:
        raise ValueError(f"flash attention: head_dim {d} > 256 is not supported")
    if varlen:
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"flash attention varlen: q has {q.shape[0]} tokens, k has {k.shape[0]}")
        n = q.shape[0]
    else:
        if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
            raise ValueError(f"flash attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ in B or N")
        n = q.shape[2]
    return hq, hkv, d, n


def _fwd(q, k, v, cu_seqlens, max_seqlen, causal, scale, varlen, config=None, window=None, softcap=None):
    hq, hkv, d, n = _check(q, k, v, varlen)
    if window is not None and (not causal or window < 1):
        raise ValueError(f"flash attention: a sliding window needs causal attention and window >= 1, got "
                         f"causal={causal}, window={window}")
    cfg = dict(fwd_config(d, q.dtype, q.device))
    cfg.update(config or {})
    assert cfg["BLOCK_M"] % cfg["BLOCK_N"] == 0, "BLOCK_M must be a multiple of BLOCK_N"
    o = torch.empty_like(q)
    if varlen:
        batch = cu_seqlens.numel() - 1
        lse = torch.empty((hq, q.shape[0]), device=q.device, dtype=torch.float32)
        slb, slh = 0, lse.stride(0)
        seqlen_static = 0
    else:
        batch = q.shape[0]
        max_seqlen = n
        lse = torch.empty((batch, hq, n), device=q.device, dtype=torch.float32)
        slb, slh = lse.stride(0), lse.stride(1)
        seqlen_static = n
    if batch == 0 or max_seqlen == 0 or q.numel() == 0:
        return o, lse
    grid = (cdiv(max_seqlen, cfg["BLOCK_M"]), hq, batch)
    _fwd_kernel[grid](
        q, k, v, o, lse, cu_seqlens if varlen else q,
        *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(o, varlen),
        slb, slh,
        seqlen_static, scale * LOG2E,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        CAUSAL=causal, VARLEN=varlen, PREC=_prec(q.dtype),
        # a window as long as every sequence changes nothing: no variant for it
        WINDOW=window if window is not None and window < max_seqlen else 0, SOFTCAP=softcap_arg(softcap),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, lse


def _bwd(do, q, k, v, o, lse, cu_seqlens, max_seqlen, causal, scale, varlen, config=None):
    hq, hkv, d, n = _check(q, k, v, varlen)
    cfg = dict(bwd_config(d, q.dtype, q.device))
    cfg.update(config or {})
    assert cfg["BLOCK_N1"] % cfg["BLOCK_M1"] == 0 and cfg["BLOCK_M2"] % cfg["BLOCK_N2"] == 0
    do = do.contiguous() if do.stride(-1) != 1 or 0 in do.stride() else do
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    if varlen:
        batch = cu_seqlens.numel() - 1
        slb, slh = 0, lse.stride(0)
        seqlen_static = 0
    else:
        batch, max_seqlen = q.shape[0], n
        slb, slh = lse.stride(0), lse.stride(1)
        seqlen_static = n
    if batch == 0 or max_seqlen == 0 or q.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    cu = cu_seqlens if varlen else q
    block_d = max(16, next_pow2(d))
    pre_m = 64 if q.device.type == "cuda" else 16
    _bwd_preprocess_kernel[(cdiv(max_seqlen, pre_m), hq, batch)](
        o, do, delta, cu, *_strides(o, varlen), *_strides(do, varlen), slb, slh, seqlen_static,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_m, VARLEN=varlen,
    )
    common = dict(GROUP=hq // hkv, HEAD_DIM=d, BLOCK_D=block_d, CAUSAL=causal, VARLEN=varlen, PREC=_prec(q.dtype),
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _bwd_dkdv_kernel[(cdiv(max_seqlen, cfg["BLOCK_N1"]), hkv, batch)](
        q, k, v, do, dk, dv, lse, delta, cu,
        *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(do, varlen),
        *_strides(dk, varlen), *_strides(dv, varlen), slb, slh,
        seqlen_static, scale * LOG2E, scale,
        BLOCK_M=cfg["BLOCK_M1"], BLOCK_N=cfg["BLOCK_N1"], **common,
    )
    _bwd_dq_kernel[(cdiv(max_seqlen, cfg["BLOCK_M2"]), hq, batch)](
        q, k, v, do, dq, lse, delta, cu,
        *_strides(q, varlen), *_strides(k, varlen), *_strides(v, varlen), *_strides(do, varlen),
        *_strides(dq, varlen), slb, slh,
        seqlen_static, scale * LOG2E, scale,
        BLOCK_M=cfg["BLOCK_M2"], BLOCK_N=cfg["BLOCK_N2"], **common,
    )
    return dq, dk, dv


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, causal, scale, varlen):
        o, lse = _fwd(q, k, v, cu_seqlens, max_seqlen, causal, scale, varlen)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens if varlen else None)
        ctx.meta = (max_seqlen, causal, scale, varlen)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu = ctx.saved_tensors
        max_seqlen, causal, scale, varlen = ctx.meta
        dq, dk, dv = _bwd(do, q, k, v, o, lse, cu, max_seqlen, causal, scale, varlen)
        return dq, dk, dv, None, None, None, None, None


def _check_cu(cu_seqlens: torch.Tensor, q: torch.Tensor) -> None:
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be int32 [B + 1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {q.device}")


def flash_attn_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = True,
    scale: Optional[float] = None,
    config: Optional[dict] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward only. q [T, Hq, D], k/v [T, Hkv, D], cu_seqlens int32 [B+1], max_seqlen (host int, an upper
    bound of the lengths). window (causal only): sliding-window attention, query i sees keys
    i - window + 1 .. i. softcap: scores s -> softcap * tanh(s / softcap) (Gemma 2).
    Returns (o [T, Hq, D], lse fp32 [Hq, T], natural log)."""
    _check_cu(cu_seqlens, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _fwd(q, k, v, cu_seqlens.contiguous(), int(max_seqlen), causal, scale, True, config, window, softcap)


def flash_attn_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    causal: bool = True,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Differentiable varlen attention: q [T, Hq, D], k/v [T, Hkv, D] -> o [T, Hq, D]."""
    _check_cu(cu_seqlens, q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _FlashAttnFunc.apply(q, k, v, cu_seqlens.contiguous(), int(max_seqlen), causal, scale, True)


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: Optional[float] = None
) -> torch.Tensor:
    """Differentiable attention in SDPA's layout: q [B, Hq, N, D], k/v [B, Hkv, N, D] -> [B, Hq, N, D]."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _FlashAttnFunc.apply(q, k, v, None, q.shape[2], causal, scale, False)


# ----------------------------------------------------------------------------------------------
# references
# ----------------------------------------------------------------------------------------------


def flash_attention_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True, scale: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention in float32 (differentiable). q [B, Hq, N, D], k/v [B, Hkv, N, D]; window: causal
    sliding-window attention (query i sees keys i - window + 1 .. i); softcap: capped scores.
    Returns (o [B, Hq, N, D] in q's dtype, lse fp32 [B, Hq, N])."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    s = soft_cap(torch.matmul(q.float(), kk.transpose(-1, -2)) * scale, softcap)
    if causal:
        n = q.shape[2]
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            allowed &= ~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-window)
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(torch.softmax(s, dim=-1), vv)
    return o.to(q.dtype), lse


def flash_attn_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool = True,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for the varlen layout: returns (o [T, Hq, D], lse fp32 [Hq, T]); one sequence at a time."""
    cu = cu_seqlens.tolist()
    outs, lses = [], []
    for s, e in zip(cu[:-1], cu[1:]):
        o, lse = flash_attention_ref(
            q[s:e].transpose(0, 1)[None], k[s:e].transpose(0, 1)[None], v[s:e].transpose(0, 1)[None], causal, scale,
            window, softcap,
        )
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs, 0), torch.cat(lses, 1)
