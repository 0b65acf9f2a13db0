"""Decode attention (one query per sequence) over the paged KV cache: Flash-Decoding in Triton.

Kernel 1, grid ``(num_splits, Hkv, B)``: each program takes the G = Hq/Hkv query heads of one KV head
of one sequence (one ``[BLOCK_H >= 16, D]`` Q tile, so the G heads share every K/V load) and a share
of the sequence's keys, read BLOCK_N at a time through the block table with an online softmax: by
default (STRIDED) the tiles split, split + num_splits, ...; otherwise one contiguous chunk. Each
tile's block ids are loaded one iteration ahead (BT_AHEAD), so that the K/V loads never wait on the
block table (and with 2+ stages Triton's pipeliner double-buffers the copies). With ``num_splits == 1``
it writes the output directly; otherwise it writes an fp32 partial output (normalised within its keys)
and its log-sum-exp (base 2), and kernel 2, grid ``(Hq, B, D / 32)``, rescales and sums the partials --
or, given a counters buffer, the last program of each (sequence, KV head) to finish does that itself
(an acq_rel atomic counter per (sequence, KV head)).

CUDA-graph safe: ``num_splits`` is a static function of (batch, Hkv, block-table width, SM count),
never of the lengths; each program's keys follow from ``seq_lens`` on the device, and a program with
no keys writes nothing: the combine reads only the live splits (``live_splits``).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from pageflash.envs import int_env
from pageflash.kernels.device_info import high_bandwidth_per_sm, memory_bandwidth_per_sm, pdl_supported
from pageflash.kernels.flash_attention import scale_scores, softcap_arg
from pageflash.kernels.host_math import cdiv, next_pow2
from pageflash.kernels.kv_store import check_store_args, kv_scale_args, store_quantized_row
from pageflash.kernels.launch import fast_launch
from pageflash.layers.attention import _decode_batched_ref

__all__ = ["flash_decode", "flash_decode_ref", "choose_num_splits", "decode_config", "split_range", "pv_f16_weights",
           "f16_codes"]

LOG2E = 1.4426950408889634


@triton.jit
def split_chunk(end, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split over keys [0, end): equal chunks in multiples of BLOCK_N."""
    return tl.cdiv(tl.cdiv(end, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def split_range(end, split, num_splits, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, start=0):
    """Keys [lo, hi) of program `split` of num_splits over keys [start, end) (start a multiple of
    BLOCK_N): `split_chunk` keys each (the last ones may be short or empty); all of them without SPLIT."""
    if SPLIT:
        chunk = split_chunk(end - start, num_splits, BLOCK_N)
        lo = start + split * chunk
        hi = tl.minimum(lo + chunk, end)
    else:
        lo = start
        hi = end
    return lo, hi


@triton.jit
def live_splits(end, num_splits, BLOCK_N: tl.constexpr, STRIDED: tl.constexpr = False, start=0):
    """How many splits hold keys of [start, end) (start a multiple of BLOCK_N; at least 1, so that an
    empty sequence still has one, all -inf). STRIDED: split s holds tiles s, s + num_splits, ... of
    BLOCK_N keys counted from start."""
    n = end - start
    if STRIDED:
        return tl.minimum(tl.maximum(tl.cdiv(n, BLOCK_N), 1), num_splits)
    else:
        return tl.maximum(tl.cdiv(n, tl.maximum(split_chunk(n, num_splits, BLOCK_N), 1)), 1)


@triton.jit
def window_start(seq_len, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """The first key tile (a multiple of BLOCK_N) that holds a key of a decode query's window (the
    last WINDOW keys; 0 without a window)."""
    if WINDOW > 0:
        return tl.maximum(seq_len - WINDOW, 0) // BLOCK_N * BLOCK_N
    else:
        return 0


@triton.jit
def _rope_tile(x, xp, c, s, lo_half, rot, PARTIAL: tl.constexpr):
    """Rotate-halves rotary of a [.., BLOCK_D] tile x over its first R columns (xp: the partner
    halves, x[..., (d + R/2) % R]; c, s: cos/sin per column, already rounded to x's dtype), rounded
    step by step like kernels/rotary.py: out1 = x1*c - x2*s, out2 = x2*c + x1*s. PARTIAL (R < D):
    the columns where rot is false keep x."""
    dt = x.dtype
    a = (x.to(tl.float32) * c).to(dt).to(tl.float32)
    b = (xp.to(tl.float32) * s).to(dt).to(tl.float32)
    out = tl.where(lo_half, a - b, a + b).to(dt)
    if PARTIAL:
        out = tl.where(rot, out, x)
    return out


@triton.jit
def pv_f16_weights(acc, alpha, p, v, v_sc, v_run, PREC: tl.constexpr):
    """acc x alpha + (p x v_sc) @ v with the weights p x v_sc in float16 (v: float16 codes): they are
    divided by the tile's largest scale first (<= 1 then: float16's subnormals start at 2**-14, and
    small V scales put unscaled weights there), and acc is counted in units of that scale -- v_run,
    the previous unit, rescaled together with alpha, so no extra pass over acc. Returns (acc, unit)."""
    v_top = tl.max(v_sc, 0)
    v_top = tl.where(v_top > 0.0, v_top, 1.0)
    acc = acc * (alpha * (v_run / v_top))[:, None]
    acc = tl.dot((p * (v_sc / v_top)[None, :]).to(v.dtype), v, acc, input_precision=PREC)
    return acc, v_top


# num_splits is not specialized: the batch buckets' split counts share one compile (cold start);
# nor is the block-table width, which eager steps size to their longest sequence
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "bt_width"])
def _decode_split_kernel(
    Q, KC, VC, O, PO, PLSE, BT, SEQ_LENS, COUNTERS,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_bt, bt_width,
    qk_scale, num_splits,
    KN, VN, POS, COS, SIN, SLOTS, stride_knb, stride_knh, stride_vnb, stride_vnh, stride_cos, stride_sin,
    KS, VS, stride_sb, stride_sh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr, FUSED: tl.constexpr,
    BLOCK_S: tl.constexpr, PREC: tl.constexpr, ROPE: tl.constexpr,
    BT_AHEAD: tl.constexpr = 0, STRIDED: tl.constexpr = False,
    QUANT: tl.constexpr = False, QMAX: tl.constexpr = 1.0, CODE_INT: tl.constexpr = False,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0, ROT_DIM: tl.constexpr = 0,
    F16_CODES: tl.constexpr = False, PDL: tl.constexpr = 0,
):
    # PDL (split launches whose combine is launched with launch_pdl): 1 lets the combine's programs be
    # scheduled once every program here has started, 2 once every program has left its key loop; they
    # wait (gdc_wait) for this grid's end before reading the partials. 0: no signal.
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    # ROT_DIM: with ROPE, how many leading dims of each head rotate (HEAD_DIM, or fewer: partial rotary)
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b)
    # WINDOW: a sliding-window layer; its query sees keys [seq_len - WINDOW, seq_len), which the splits
    # share from the tile holding the first of them (w0) on
    w0 = window_start(seq_len, WINDOW, BLOCK_N)
    if STRIDED and SPLIT:
        # tiles split, split + num_splits, ...: the first tile's position needs no seq_len (no window)
        lo = w0 + split * BLOCK_N
        hi = seq_len
        step = num_splits * BLOCK_N
    else:
        lo, hi = split_range(seq_len, split, num_splits, BLOCK_N, SPLIT, w0)
        step = BLOCK_N
    if SPLIT:
        eff = live_splits(seq_len, num_splits, BLOCK_N, STRIDED, w0)
    else:
        eff = 1
    # a program past the last split with keys writes nothing (the combine reads the first eff splits);
    # a sequence short enough for one chunk (eff == 1) is written directly, without partials
    live = split < eff
    live_i = live.to(tl.int32)  # blocks below are masked with it (scalar & block masks: broadcast first)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    h_ok = offs_h < GROUP
    d_ok = offs_d < HEAD_DIM
    head = kvh * GROUP + offs_h
    q_ptr = Q + b64 * stride_qb + head[:, None] * stride_qh
    # q, and below the new k / v, are loaded whatever the program's keys: only its stores depend on
    # seq_len, so these loads need not wait for it (a batch-1 step is a chain of memory latencies)
    q_mask = h_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + offs_d[None, :], mask=q_mask, other=0.0)
    hi_loop = hi
    if ROPE:
        # q and the new token's k are rotated here, and this token's k/v stored into the cache by the
        # program whose chunk holds it (key seq_len - 1), which takes that key from registers: the
        # separate rotary + store launch of the step goes away.
        # (columns past ROT_DIM: their partner and table column are in range but unused)
        partial: tl.constexpr = ROT_DIM < HEAD_DIM
        rot = offs_d < ROT_DIM
        lo_half = offs_d < (ROT_DIM // 2)
        partner = tl.where(lo_half, offs_d + (ROT_DIM // 2), offs_d - (ROT_DIM // 2))
        hidx = tl.where(lo_half, offs_d, offs_d - (ROT_DIM // 2))
        pos = tl.load(POS + b).to(tl.int64)
        c = tl.load(COS + pos * stride_cos + hidx, mask=rot, other=0.0).to(Q.dtype.element_ty)
        s = tl.load(SIN + pos * stride_sin + hidx, mask=rot, other=0.0).to(Q.dtype.element_ty)
        c = c.to(tl.float32)
        s = s.to(tl.float32)
        qp = tl.load(q_ptr + partner[None, :], mask=q_mask, other=0.0)
        q = _rope_tile(q, qp, c[None, :], s[None, :], lo_half[None, :], rot[None, :], partial)
        if STRIDED and SPLIT:
            owner = (seq_len > 0) & ((((seq_len - 1) - w0) // BLOCK_N) % num_splits == split)
            hi_loop = hi - 1  # == seq_len - 1: no other program's tiles hold that key
        else:
            owner = (seq_len > 0) & (lo <= seq_len - 1) & (seq_len - 1 < hi)
            hi_loop = tl.where(owner, hi - 1, hi)
        kn_ptr = KN + b64 * stride_knb + kvh * stride_knh
        kn = tl.load(kn_ptr + offs_d, mask=d_ok, other=0.0)
        knp = tl.load(kn_ptr + partner, mask=d_ok, other=0.0)
        kn = _rope_tile(kn, knp, c, s, lo_half, rot, partial)
        vn = tl.load(VN + b64 * stride_vnb + kvh * stride_vnh + offs_d, mask=d_ok, other=0.0)
        slot = tl.load(SLOTS + b).to(tl.int64)
        kn_mask = d_ok & ((tl.zeros([BLOCK_D], dtype=tl.int32) + owner.to(tl.int32)) > 0)
        st_mask = kn_mask & ((tl.zeros([BLOCK_D], dtype=tl.int64) + slot) >= 0)
        sblk = tl.maximum(slot, 0) // PAGE_SIZE
        soff = tl.maximum(slot, 0) % PAGE_SIZE
        if QUANT:
            # quantized as kv_store.store_quantized_rows does; the registers then hold what the cache
            # reads back (code x scale), as every other key
            s_new = sblk * stride_sb + kvh * stride_sh + soff
            st_ok = owner & (slot >= 0)
            kn = store_quantized_row(kn, KC + sblk * stride_kcb + soff * stride_kcs + kvh * stride_kch + offs_d,
                                     KS + s_new, st_mask, st_ok, QMAX, CODE_INT)
            vn = store_quantized_row(vn, VC + sblk * stride_vcb + soff * stride_vcs + kvh * stride_vch + offs_d,
                                     VS + s_new, st_mask, st_ok, QMAX, CODE_INT)
        else:
            tl.store(KC + sblk * stride_kcb + soff * stride_kcs + kvh * stride_kch + offs_d,
                     kn.to(KC.dtype.element_ty), mask=st_mask)
            tl.store(VC + sblk * stride_vcb + soff * stride_vcs + kvh * stride_vch + offs_d,
                     vn.to(VC.dtype.element_ty), mask=st_mask)
    bt_row = BT + b64 * stride_bt
    if QUANT and F16_CODES:
        # F16_CODES (f16_codes: a bf16 q over e4m3 codes, or a float16 q): the codes widen to float16 and
        # q is converted once to meet them (float16 holds bf16's values to +-65504 with more mantissa;
        # beyond, clamped); the weights of V go through float16 scaled to [0, 1] (pv_f16_weights, v_run)
        q_dot = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    else:
        q_dot = q
    k_base = KC + kvh * stride_kch
    v_base = VC + kvh * stride_vch
    if QUANT:
        ks_base = KS + kvh * stride_sh
        vs_base = VS + kvh * stride_sh

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    v_run = 1.0  # acc's unit (F16_CODES: the last tile's largest V scale; otherwise 1)
    if ROPE:
        # the new key first, from registers (the owner only: everyone else starts empty), so that kn / vn
        # are dead before the key loop: kept until after it, they held 156 registers a thread instead of
        # 119 (H100, BLOCK_N 64, 4 warps), 3 programs an SM instead of 4, and the long-context decode
        # took 1.3x (run 49)
        qk_n = scale_scores(tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1), qk_scale, SOFTCAP)
        qk_n = tl.where(owner, qk_n, float("-inf"))
        m_i = tl.maximum(m_i, qk_n)
        p_n = tl.math.exp2(qk_n - m_i).to(vn.dtype).to(tl.float32)
        l_i = p_n
        acc = p_n[:, None] * vn.to(tl.float32)[None, :]
    # BT_AHEAD: a tile's block ids are loaded one iteration ahead (the first before the loop), masked by
    # the table's width only (not by seq_len: the first load need not wait for it). The K/V copies then
    # depend on no load of their own iteration, and Triton's pipeliner gives them num_stages - 1
    # shared-memory buffers; with the block-table load inside the iteration it gives them one, whatever
    # num_stages, and each copy waits for that load (docs/KERNELS.md). (Two tiles ahead: no pipelining.)
    if BT_AHEAD:
        ja = lo + offs_n
        blk_a = tl.load(bt_row + ja // PAGE_SIZE, mask=ja // PAGE_SIZE < bt_width, other=0)
    for start_n in range(lo, hi_loop, step):
        j = start_n + offs_n
        kv_ok = j < hi_loop
        if WINDOW > 0:
            kv_ok = kv_ok & (j >= seq_len - WINDOW)
        if BT_AHEAD:
            blk = blk_a.to(tl.int64)
            jn = j + step
            blk_a = tl.load(bt_row + jn // PAGE_SIZE, mask=jn // PAGE_SIZE < bt_width, other=0)
        else:
            blk = tl.load(bt_row + j // PAGE_SIZE, mask=kv_ok, other=0).to(tl.int64)
        slot_n = (j % PAGE_SIZE)[:, None]
        if BLOCK_D != HEAD_DIM:
            ld_mask = kv_ok[:, None] & d_ok[None, :]
        else:
            ld_mask = kv_ok[:, None]
        k = tl.load(k_base + blk[:, None] * stride_kcb + slot_n * stride_kcs + offs_d[None, :], mask=ld_mask, other=0.0)
        v = tl.load(v_base + blk[:, None] * stride_vcb + slot_n * stride_vcs + offs_d[None, :], mask=ld_mask, other=0.0)
        if QUANT:  # codes (exact in q's dtype) into the dots; the scales multiply scores and weights
            s_at = blk * stride_sb + (j % PAGE_SIZE)
            k_sc = tl.load(ks_base + s_at, mask=kv_ok, other=0.0)
            v_sc = tl.load(vs_base + s_at, mask=kv_ok, other=0.0)
            k = k.to(q_dot.dtype)
            v = v.to(q_dot.dtype)
        qk = tl.dot(q_dot, tl.trans(k), input_precision=PREC)
        if QUANT:
            qk = qk * k_sc[None, :]
        qk = tl.where(kv_ok[None, :], scale_scores(qk, qk_scale, SOFTCAP), float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT and F16_CODES:
            acc, v_run = pv_f16_weights(acc, alpha, p, v, v_sc, v_run, PREC)
        elif QUANT:
            acc = acc * alpha[:, None]
            acc = tl.dot((p * v_sc[None, :]).to(v.dtype), v, acc, input_precision=PREC)
        else:
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_ij
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if QUANT and F16_CODES:
        out = acc * (v_run / l_safe)[:, None]
    else:
        out = acc / l_safe[:, None]
    mask = h_ok[:, None] & d_ok[None, :]
    if not SPLIT:
        tl.store(O + b64 * stride_ob + head[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mask)
    elif eff == 1:
        tl.store(O + b64 * stride_ob + head[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=mask & ((tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int32) + live_i) > 0))
    else:
        # partials: PO [B, Hq, num_splits, D] fp32, PLSE [B, Hq, num_splits] fp32 (contiguous)
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        hq = GROUP * tl.num_programs(1)
        row = (b64 * hq + head) * num_splits + split
        tl.store(PO + row[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=mask & ((tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int32) + live_i) > 0))
        tl.store(PLSE + row, lse, mask=h_ok & ((tl.zeros([BLOCK_H], dtype=tl.int32) + live_i) > 0))
        if FUSED:
            # the last program of this (sequence, KV head) to finish combines the eff partials: saves a
            # launch. Barrier + acq_rel atomic: every thread's partial stores are visible before the
            # count moves; the partials are then read past L1 (.cg).
            tl.debug_barrier()
            cnt_ptr = COUNTERS + b64 * tl.num_programs(1) + kvh
            done = tl.atomic_add(cnt_ptr, 1, mask=live, sem="acq_rel", scope="gpu")
            if live & (done == eff - 1):
                offs_s = tl.arange(0, BLOCK_S)
                s_ok = offs_s < eff
                for g in tl.static_range(GROUP):
                    hg = kvh * GROUP + g
                    row0 = (b64 * hq + hg) * num_splits
                    lse_s = tl.load(PLSE + row0 + offs_s, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
                    m_s = tl.max(lse_s, 0)
                    w = tl.math.exp2(lse_s - tl.where(m_s == float("-inf"), 0.0, m_s))
                    den = tl.sum(w, 0)
                    w = w / tl.where(den > 0.0, den, 1.0)
                    po = tl.load(PO + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                                 mask=(s_ok & (w > 0.0))[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
                    tl.store(O + b64 * stride_ob + hg * stride_oh + offs_d,
                             tl.sum(po * w[:, None], 0).to(O.dtype.element_ty), mask=d_ok)
                tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")  # reset for the next launch


_decode_split_kernel = fast_launch(_decode_split_kernel)  # host launches via the cached CompiledKernel


@triton.jit(do_not_specialize=["num_splits"])
def _decode_combine_kernel(
    O, PO, PLSE, SEQ_LENS, stride_ob, stride_oh, num_splits,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    LENS: tl.constexpr, BLOCK_N: tl.constexpr, STRIDED: tl.constexpr = False, BLOCK_DC: tl.constexpr = 0,
    EAGER: tl.constexpr = False, WINDOW: tl.constexpr = 0, PDL: tl.constexpr = False,
):
    """Grid (Hq, rows, D / BLOCK_DC): program (h, r, c) combines columns [c * BLOCK_DC, ...) of row r,
    head h (BLOCK_DC 0: all of D). EAGER (decode partials, LENS): every split's partial is loaded
    alongside seq_len and the lse, the dead ones dropped afterwards, so that no load waits for another.
    PDL (launched with launch_pdl after a split kernel that signals its dependents): seq_len is read,
    then the program waits for the split kernel's partials (gdc_wait) before reading them."""
    h = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if PDL:
        if LENS:
            seq_len = tl.load(SEQ_LENS + b)
        tl.extra.cuda.gdc_wait()
    offs_s = tl.arange(0, BLOCK_S)
    if BLOCK_DC == 0:
        offs_d = tl.arange(0, BLOCK_D)
    else:
        offs_d = tl.program_id(2) * BLOCK_DC + tl.arange(0, BLOCK_DC)
    d_ok = offs_d < HEAD_DIM
    row0 = (b * NUM_HEADS + h) * num_splits
    # every split's lse, loaded alongside seq_len (not after it); the dead ones are masked below
    lse_all = tl.load(PLSE + row0 + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    if EAGER:
        # stale rows of dead splits are read too and dropped by the where below (never multiplied)
        po_all = tl.load(PO + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                         mask=(offs_s < num_splits)[:, None] & d_ok[None, :], other=0.0)
    if LENS:  # the decode kernel's splits: only the first eff hold partials; eff == 1 wrote O itself
        if not PDL:
            seq_len = tl.load(SEQ_LENS + b)
        eff = live_splits(seq_len, num_splits, BLOCK_N, STRIDED, window_start(seq_len, WINDOW, BLOCK_N))
    else:
        eff = num_splits
    if (eff > 1) | (not LENS):
        s_ok = offs_s < eff
        lse = tl.where(s_ok, lse_all, float("-inf"))
        m = tl.max(lse, 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # seq_len 0 (a padded batch slot): every split empty -> 0
        w = tl.math.exp2(lse - m)
        den = tl.sum(w, 0)
        w = w / tl.where(den > 0.0, den, 1.0)
        if EAGER:
            po = tl.where(s_ok[:, None], po_all, 0.0)
        else:
            # splits with no partial are not read: at short lengths most of a decode step's splits are
            # dead. The decode kernel's live splits all hold keys, so their load waits only for seq_len,
            # not for the lse loads; paged_attention's splits may be empty (weight 0, rows unwritten)
            if LENS:
                po_ok = s_ok
            else:
                po_ok = s_ok & (w > 0.0)
            po = tl.load(PO + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                         mask=po_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(po * w[:, None], 0)
        tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=d_ok)


_decode_combine_kernel = fast_launch(_decode_combine_kernel)  # host launches via the cached CompiledKernel


@functools.lru_cache(maxsize=64)
def decode_config(head_dim: int, dtype: torch.dtype, device: torch.device, split: bool = False,
                  kv_dtype: Optional[torch.dtype] = None) -> dict:
    """BLOCK_N, num_warps, num_stages of the split kernel (static: CUDA-graph friendly), its two layout
    switches, and the combine's settings (COMBINE_*: see ``combine_partials``); ``split``: for a launch
    with num_splits > 1. BT_AHEAD=1 loads a tile's block ids one iteration ahead (the K/V copies never
    wait on the block table; with 2+ stages Triton's pipeliner then gives them num_stages - 1 buffers),
    STRIDED gives split s the tiles s, s + num_splits, ... (the first tile's address needs no seq_len;
    with pages in order, the programs sweep memory together). H100 / H200 sweeps in docs/KERNELS.md. Cached:
    callers copy before changing it. kv_dtype: a quantized cache's code dtype (int8 / float8_e4m3fn)."""
    # the combine: 32 columns per program over 2 warps, every split's partial loaded without waiting
    # for seq_len (H100: -0.3 to -0.5 us at batch 1 against one program per head; docs/KERNELS.md)
    # and on sm_90+ launched as a programmatic dependent of the split kernel, signalled at its start
    # (PDL; H200: -0.4 to -1.0 us a split launch, docs/KERNELS.md); 0 elsewhere
    comb = dict(COMBINE_BLOCK_DC=32, COMBINE_EAGER=True, COMBINE_num_warps=2, PDL=decode_pdl(device))
    if device.type != "cuda":
        return dict(BLOCK_N=16, num_warps=4, num_stages=1, BT_AHEAD=1, STRIDED=True, **comb)
    d = next_pow2(head_dim)
    if dtype == torch.float32 or d > 128:
        return dict(BLOCK_N=32, num_warps=4, num_stages=2, BT_AHEAD=1, STRIDED=True, **comb)
    if kv_dtype is not None and kv_dtype.itemsize == 1:
        # 1-byte codes: 64-key tiles through a 3-stage copy pipeline, 2 warps a program (more programs
        # per SM: the widening of the codes is latency-bound, not the copy). H100, 32 / 8 heads, D 128
        # (scripts/kvq_decode_probe.py, docs/BENCHMARKS.md run 32): the bf16 config (64 keys, 4 warps,
        # 1 stage) held 41-61% of copy bandwidth, 128 keys / 4 warps / 3 stages 60-81%, this one 65-87%
        # (int8; e4m3 58-78%, 66-89% since run 50's float16 codes). At D 64 (run 50, 9 / 3 heads), int8
        # split programs take 128 keys over 4 warps, as the bf16 config does there: 30.9 vs 35.1 us at
        # B64 L2k and 31.0 vs 35.1 at B1 L128k, 0.9 us behind at B8 L8k; unsplit grids keep this config
        # (B256 L1k: 50.2 vs 55.5). e4m3 keeps it everywhere: its float16 path holds 168 registers a
        # thread at 128 keys / 4 warps, 3 programs an SM, and at B8 L8k (22 splits) took 1.46x the time
        if d <= 64 and split and kv_dtype == torch.int8:
            return dict(BLOCK_N=128, num_warps=4, num_stages=3, BT_AHEAD=1, STRIDED=True, **comb)
        return dict(BLOCK_N=64, num_warps=2, num_stages=3, BT_AHEAD=1, STRIDED=True, **comb)
    if d <= 64:
        # small heads (smollm2-135m: D 64): split programs take 128 keys a tile, so that a tile moves
        # as many bytes as at D 128 (H100, 9 / 3 heads: -10 to -15% at B1-B64); unsplit grids keep 64
        # keys and ~22 KB of shared memory, so that B256 x 3 KV heads fit one wave (128 keys: +7%)
        return dict(BLOCK_N=128 if split else 64, num_warps=4, num_stages=2, BT_AHEAD=1, STRIDED=True, **comb)
    # 1 stage: the K/V tiles are plain loads into registers, staged through ~22 KB of shared memory for
    # the dots; programs per SM, not a copy pipeline, hide the latency. H100 (32 / 8 heads, D 128):
    # equal to 2 stages (~39 KB) over shuffled pages, 0.5-2% faster over pages in order and over
    # SDPA's contiguous buffers (at D 64, 1 stage is 0-7% slower). A memory with more bandwidth per SM
    # needs more bytes in flight per SM (Little's law), which the copy pipeline gives: on the H200 two
    # stages are 6-9% faster than one on every W-attn-decode shape (run 58); see decode_stages
    return dict(BLOCK_N=64, num_warps=4, num_stages=decode_stages(device), BT_AHEAD=1, STRIDED=True, **comb)


def stages_for_bandwidth(bw_per_sm: Optional[float]) -> int:
    """Copy-pipeline stages of the D 65-128 16-bit decode config for a GPU of this peak bandwidth per
    SM: 1 up to STAGES_BW_PER_SM (or unknown), 2 above."""
    return 2 if high_bandwidth_per_sm(bw_per_sm) else 1


def decode_stages(device: torch.device) -> int:
    """The D 65-128 16-bit decode config's stages on this CUDA device; PAGEFLASH_DECODE_STAGES=1 or 2
    forces one (0 or unset: by the device's bandwidth per SM, stages_for_bandwidth)."""
    forced = int_env("PAGEFLASH_DECODE_STAGES", 0)
    if forced > 2:
        raise ValueError(f"PAGEFLASH_DECODE_STAGES must be 0 (by the GPU), 1 or 2, got {forced}")
    if forced:
        return forced
    return stages_for_bandwidth(memory_bandwidth_per_sm(torch.cuda.get_device_properties(device)))


def decode_pdl(device: torch.device) -> int:
    """The split decode launches' PDL mode (flash_decode's config "PDL"): 1 where supported
    (``pdl_supported``), else 0. PAGEFLASH_DECODE_PDL=0 turns it off; 1 or 2 (signal after the key
    loop) force a mode where supported."""
    forced = int_env("PAGEFLASH_DECODE_PDL", -1)
    if forced not in (-1, 0, 1, 2):
        raise ValueError(f"PAGEFLASH_DECODE_PDL must be 0 (off), 1 or 2, got {forced}")
    if forced == 0 or not pdl_supported(device):
        return 0
    return 1 if forced == -1 else forced


def f16_codes(q_dtype: torch.dtype, kv_dtype: Optional[torch.dtype], override: Optional[bool] = None) -> bool:
    """Whether a kernel reading a quantized cache (kv_dtype: its codes; None: not quantized) widens the
    codes to float16 and meets them with q in float16 (F16_CODES), rather than widening them to q's dtype.
    e4m3 widens to float16 in one instruction a pair and to bfloat16 in several: with a bf16 q, 1.12-1.23x
    faster decode on H100 (run 50, scripts/kvq_f16_probe.py); int8 widens faster to bf16 and stays there.
    A float16 q always takes the path (its weights p x scale scaled out of float16's subnormals), a
    float32 q never. override (a config's F16_CODES, probes): the choice for a bf16 q."""
    if kv_dtype is None or q_dtype == torch.float32:
        return False
    if q_dtype == torch.float16:
        return True
    return bool(override) if override is not None else kv_dtype == torch.float8_e4m3fn


# Decode splits at short bounds: at least this many (PAGEFLASH_DECODE_MIN_SPLITS; 1: chunks of
# min_chunk keys only). A bound under 16 x 256 keys would otherwise get few splits, each a long chain of
# tiles at small batches: H200, 32 / 8 heads, batch 1, sequences filling the bound, 512 / 1024 keys
# take 8.22 / 8.30 us at the 2 / 4 splits of 256-key chunks and 4.53 / 4.94 us at 16 (run 60,
# docs/BENCHMARKS.md). Sliding windows are such bounds at every length: gemma-3-1b (512-key windows,
# 9 splits instead of 3) decodes 1.14x faster at a 3k context.
DECODE_MIN_SPLITS = 16
# keys a split gets at least under that floor (a D <= 128 decode tile)
_MIN_SPLIT_KEYS = 64


@functools.lru_cache(maxsize=1)
def decode_min_splits() -> int:
    return int_env("PAGEFLASH_DECODE_MIN_SPLITS", DECODE_MIN_SPLITS, minimum=1)


def choose_num_splits(
    batch: int, num_kv_heads: int, max_kv_len: int, num_sms: int, min_chunk: int = 256, slots_per_sm: int = 4,
    max_splits: int = 128, min_splits: Optional[int] = None,
) -> int:
    """Splits per sequence, from static quantities only (CUDA graphs): 1 when batch x Hkv programs
    already give every SM two; otherwise as many splits as fit one wave of ``slots_per_sm`` programs
    per SM (more than one wave leaves a tail: measured on H100, docs/KERNELS.md), with chunks of at
    least ``min_chunk`` keys of the length bound ``max_kv_len``, but at least ``min_splits`` (default
    ``decode_min_splits()``) of >= 64 keys where the wave has room (short bounds)."""
    programs = max(1, batch * num_kv_heads)
    if programs >= 2 * num_sms:
        return 1
    if min_splits is None:
        min_splits = decode_min_splits()
    wave = max(1, (slots_per_sm * num_sms) // programs)
    want = max(cdiv(max_kv_len, min_chunk), min(min_splits, cdiv(max_kv_len, _MIN_SPLIT_KEYS)))
    return max(1, min(wave, want, max_splits))


def flash_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int = 1,
    config: Optional[dict] = None,
    counters: Optional[torch.Tensor] = None,
    rope: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    k_new: Optional[torch.Tensor] = None,
    v_new: Optional[torch.Tensor] = None,
    slot_mapping: Optional[torch.Tensor] = None,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    out: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Decode attention: q [B, Hq, D] (one query per sequence, its K/V already stored), caches
    [num_blocks, block_size, Hkv, D], block_tables int32 [B, W], seq_lens int32 [B] (>= 1).
    Returns [B, Hq, D]. No host synchronisation.

    counters: optional int32 [>= B * Hkv] buffer of zeros, owned by the caller and used by one launch
    at a time: with it (and num_splits > 1) the last split program of each (sequence, KV head) combines
    the partials itself (and resets its counter to 0), instead of a second kernel.

    rope=(positions [B], cos [P, R/2], sin [P, R/2]) with k_new, v_new [B, Hkv, D] and slot_mapping [B]:
    the step's rotary embedding and K/V store in the same launch (positions: table rows,
    RotaryEmbedding.rows; R <= D: the first R dims of each head rotate, the rest pass through, as
    partial rotary embeddings do). q and k_new are the *unrotated*
    projections (q is not modified); each query is rotated at its position, the new key rotated, and
    both k and v written to the cache at the token's slot (-1: not stored), exactly as
    ``apply_rotary(q, k_new, *rope, v=v_new, k_cache=..., v_cache=..., slot_mapping=...)`` followed by
    this call without rope would; key seq_len - 1 (the new token's) is taken from registers.

    kv_scales=(k_scale, v_scale), float32 [num_blocks, Hkv, block_size]: the caches hold int8 /
    float8_e4m3fn codes, one scale per (token, KV head) (pageflash.layers.attention's module doc).

    out: where to write the result ([B, Hq, D] of q's dtype, D contiguous; e.g. rows of a larger
    step's output); a new tensor when None.

    window: a sliding-window layer's: each query sees only the last ``window`` keys of its sequence
    (the splits share those; ``choose_num_splits`` may be given min(max_kv_len, window + BLOCK_N)).

    softcap: scores s -> softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"flash_decode: q must be [B, Hq, D] and caches [num_blocks, block_size, Hkv, D], got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    b, hq, d = q.shape
    _, page, hkv, dk = k_cache.shape
    if dk != d or hq % hkv:
        raise ValueError(f"flash_decode: q heads/dim {(hq, d)} incompatible with cache heads/dim {(hkv, dk)}")
    qargs, qconst = kv_scale_args(k_cache, v_cache, kv_scales, "flash_decode")
    if not qconst["QUANT"] and not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"flash_decode: dtypes differ: q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"flash_decode: q must be float16/bfloat16/float32, got {q.dtype}")
    qs, ks, vs, bts = q.stride(), k_cache.stride(), v_cache.stride(), block_tables.stride()
    if qs[-1] != 1 or ks[-1] != 1 or vs[-1] != 1:
        raise ValueError("flash_decode: q and caches must be contiguous in head_dim")
    if seq_lens.shape != (b,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"flash_decode: seq_lens must be int32 [{b}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] < b or block_tables.dtype != torch.int32 \
            or bts[-1] != 1:
        raise ValueError(
            f"flash_decode: block_tables must be int32 [B, W] row-major, got {block_tables.dtype} "
            f"{tuple(block_tables.shape)}"
        )
    if num_splits < 1:
        raise ValueError(f"flash_decode: num_splits must be >= 1, got {num_splits}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"flash_decode: window must be a positive int or None, got {window!r}")
    if rope is not None:
        positions, cos, sin = rope
        if k_new is None or v_new is None or slot_mapping is None:
            raise ValueError("flash_decode: rope needs k_new, v_new and slot_mapping")
        check_store_args(k_new, v_new, k_cache, v_cache, slot_mapping)
        if k_new.shape != (b, hkv, d) or k_new.dtype != q.dtype:
            raise ValueError(f"flash_decode: k_new must be [{b}, {hkv}, {d}] {q.dtype}, got "
                             f"{tuple(k_new.shape)} {k_new.dtype}")
        if positions.shape != (b,) or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"flash_decode: positions must be [{b}] int32/int64, got {tuple(positions.shape)} "
                             f"{positions.dtype}")
        for name, tab in (("cos", cos), ("sin", sin)):
            if tab.dim() != 2 or not 1 <= tab.shape[1] <= d // 2 or tab.dtype != torch.float32 or tab.stride(1) != 1:
                raise ValueError(f"flash_decode: {name} must be float32 [P, R/2] with R <= head_dim ({d}), "
                                 f"contiguous in the last dim, got {tuple(tab.shape)} {tab.dtype}")
        if sin.shape[1] != cos.shape[1]:
            raise ValueError(f"flash_decode: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ in width")
        rot_dim = 2 * cos.shape[1]
        positions, slot_mapping = positions.contiguous(), slot_mapping.contiguous()
        rope_args = (k_new, v_new, positions, cos, sin, slot_mapping, k_new.stride(0), k_new.stride(1),
                     v_new.stride(0), v_new.stride(1), cos.stride(0), sin.stride(0))
    elif k_new is not None or v_new is not None or slot_mapping is not None:
        raise ValueError("flash_decode: k_new, v_new and slot_mapping go with rope")
    else:
        # unused without ROPE: None arguments are constexprs to Triton, so they cost no per-launch binding
        rope_args = (None,) * 12
        rot_dim = 0
    if out is None:
        o = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 or out.device != q.device:
        raise ValueError(f"flash_decode: out must be {q.dtype} {tuple(q.shape)} contiguous in head_dim, got "
                         f"{out.dtype} {tuple(out.shape)}")
    else:
        o = out
    os_ = o.stride()
    if b == 0:
        return o
    group = hq // hkv
    cfg = dict(decode_config(d, q.dtype, q.device, num_splits > 1, k_cache.dtype if qconst["QUANT"] else None))
    cfg.update(config or {})
    block_d = max(16, next_pow2(d))
    if num_splits > 1:
        po = torch.empty((b, hq, num_splits, d), device=q.device, dtype=torch.float32)
        plse = torch.empty((b, hq, num_splits), device=q.device, dtype=torch.float32)
    else:
        po = plse = None
    # the fused combine unrolls over the group's heads and holds [splits, D] fp32 tiles: keep it small
    fused = counters is not None and 1 < num_splits <= 64 and group <= 16
    if fused and (counters.dtype != torch.int32 or counters.numel() < b * hkv or not counters.is_contiguous()):
        raise ValueError(f"flash_decode: counters must be contiguous int32 [>= {b * hkv}], got "
                         f"{counters.dtype} {tuple(counters.shape)}")
    # PDL: the combine launched as a programmatic dependent of the split kernel (CUDA only)
    pdl = cfg.get("PDL", 0)
    if pdl not in (0, 1, 2):
        raise ValueError(f"flash_decode: config PDL must be 0, 1 or 2, got {pdl!r}")
    pdl = int(pdl) if num_splits > 1 and not fused and q.device.type == "cuda" else 0
    _decode_split_kernel[(num_splits, hkv, b)](
        q, k_cache, v_cache, o, po, plse, block_tables, seq_lens, counters if fused else None,
        qs[0], qs[1], os_[0], os_[1],
        ks[0], ks[1], ks[2],
        vs[0], vs[1], vs[2],
        bts[0], block_tables.shape[1],
        scale * LOG2E, num_splits, *rope_args, *qargs, **qconst,
        GROUP=group, BLOCK_H=max(16, next_pow2(group)), HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_N=cfg["BLOCK_N"], PAGE_SIZE=page, SPLIT=num_splits > 1, FUSED=fused, BT_AHEAD=cfg.get("BT_AHEAD", 0),
        STRIDED=bool(cfg.get("STRIDED", False)),
        BLOCK_S=next_pow2(num_splits) if fused else 1,
        PREC="ieee" if q.dtype == torch.float32 else "tf32", ROPE=rope is not None, WINDOW=window or 0,
        SOFTCAP=softcap_arg(softcap), ROT_DIM=rot_dim,
        F16_CODES=f16_codes(q.dtype, k_cache.dtype if qconst["QUANT"] else None, cfg.get("F16_CODES")),
        PDL=pdl,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        # rotary arithmetic rounded step by step (as kernels/rotary.py): no FMA contraction there
        enable_fp_fusion=rope is None,
    )
    if num_splits > 1 and not fused:
        combine_partials(o, po, plse, lens=(seq_lens, cfg["BLOCK_N"]), strided=bool(cfg.get("STRIDED", False)),
                         config={**{k[len("COMBINE_"):]: v for k, v in cfg.items() if k.startswith("COMBINE_")},
                                 "PDL": pdl > 0},
                         window=window)
    return o


def combine_partials(o: torch.Tensor, po: torch.Tensor, plse: torch.Tensor,
                     lens: Optional[tuple[torch.Tensor, int]] = None, strided: bool = False,
                     config: Optional[dict] = None, window: Optional[int] = None) -> None:
    """o[r, h] = the splits' partial outputs po [R, Hq, S, D] (fp32) weighted by their log2-domain
    log-sum-exps plse [R, Hq, S]; a row whose splits are all empty (lse -inf) becomes zeros. The tile
    over splits is at least 16, so that the batch buckets' split counts share a few compiles.
    lens=(seq_lens, BLOCK_N): the decode kernel's partials, of which only the live splits were
    written (``live_splits``), none where one split held every key (o already written).
    strided: the decode kernel's STRIDED splits (live splits counted accordingly); window: its
    sliding window (the splits share the window's keys).
    config: BLOCK_DC (columns per program; 0: all of D), EAGER (with lens: read every split's partial
    without waiting for seq_len), num_warps, PDL (CUDA: launched as a programmatic dependent launch of
    the kernel before it, waiting for it in-kernel; that kernel signals with gdc_launch_dependents)."""
    rows, hq, num_splits, d = po.shape
    seq_lens, block_n = lens if lens is not None else (plse, 1)
    block_d = max(16, next_pow2(d))
    cfg = dict(BLOCK_DC=0, EAGER=False, num_warps=4 if d >= 128 else 2, PDL=False)
    cfg.update(config or {})
    block_dc = cfg["BLOCK_DC"]
    if block_dc and (block_dc & (block_dc - 1) or block_dc < 16):
        raise ValueError(f"combine_partials: BLOCK_DC must be 0 or a power of two >= 16, got {block_dc}")
    chunks = cdiv(block_d, block_dc) if block_dc else 1
    _decode_combine_kernel[(hq, rows, chunks)](
        o, po, plse, seq_lens, o.stride(0), o.stride(1), num_splits,
        NUM_HEADS=hq, HEAD_DIM=d, BLOCK_D=block_d,
        BLOCK_S=max(16, next_pow2(num_splits)), LENS=lens is not None, BLOCK_N=block_n,
        STRIDED=strided, BLOCK_DC=min(block_dc, block_d), EAGER=bool(cfg["EAGER"]) and lens is not None,
        WINDOW=(window or 0) if lens is not None else 0, num_warps=cfg["num_warps"],
        **(dict(PDL=True, launch_pdl=True) if cfg["PDL"] and o.device.type == "cuda" else {}),
    )


def flash_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Reference (float32 math, q's dtype out): the batched decode of pageflash.layers.attention."""
    from pageflash.layers.attention import AttentionMetadata

    b = q.shape[0]
    lens = seq_lens.tolist()
    meta = AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=q.device),
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=torch.full((b,), -1, dtype=torch.int64, device=q.device),
        query_lens_cpu=[1] * b,
        seq_lens_cpu=lens,
        block_size=k_cache.shape[1],
    )
    return _decode_batched_ref(q, k_cache, v_cache, meta, scale, kv_scales, window, softcap)
