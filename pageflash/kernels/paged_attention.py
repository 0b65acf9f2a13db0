"""Attention of a step's new queries over the paged KV cache: prefill, chunked prefill, prefix-cache
hits and multi-token (speculative / tree) decode, in one Triton kernel.

The new tokens' K/V are already in the cache (``store_kv``); every key is read through the block
table. Sequence ``i`` has ``query_len_i`` new queries (rows ``query_start_loc[i]:query_start_loc[i+1]``
of q) and ``seq_len_i`` keys; new query ``j`` sits at position ``ctx_i + j`` with
``ctx_i = seq_len_i - query_len_i`` and sees every context key plus new keys ``0..j`` (causal), or the
new keys ``t`` with ``tree_mask[row, t]``.

Tiling (GQA packing): one program handles BQ consecutive queries of one sequence for all ``G = Hq/Hkv``
query heads of one KV head: the M dimension of the tile is ``BLOCK_M = BQ * G_pad`` rows, row
``r = qi * G_pad + g`` (query ``qi``, head ``g`` of the group; the heads of a group are adjacent in q,
so the Q tile is one strided block). Each K/V tile of BLOCK_N keys is loaded once for the G heads.
The keys are streamed with an online softmax; the keys that every row of the tile sees (context and
new keys left of the tile's first query) run without masks, the rest with the causal/tree mask.

Grid: ``(num_tiles, Hkv)``; the tile list (sequence, query block) is built once per step on the host
by :func:`build_tiles` (``TritonBackend.plan``), heaviest tiles first.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from pageflash.kernels.flash_attention import has_large_smem, scale_scores, softcap_arg
from pageflash.kernels.flash_decoding import f16_codes, pv_f16_weights, split_range
from pageflash.kernels.host_math import next_pow2
from pageflash.kernels.kv_store import kv_scale_args
from pageflash.kernels.launch import fast_launch
from pageflash.layers.attention import paged_attention_ref
from pageflash.transfer import to_device

__all__ = ["paged_attention", "paged_attention_ref", "build_tiles", "prefill_config"]

LOG2E = 1.4426950408889634


@triton.jit
def page_ids_load(bt_row, start, bt_width, PAGE_SIZE: tl.constexpr, BT_PAGES: tl.constexpr):
    """The block ids of the BT_PAGES (1..8) pages a tile at key `start` spans (start a multiple of the
    tile's length; page_ids_per_tile): one load of one address per page instead of one gathered load
    per key; ids past the table's width are 0 (their keys are masked or never read). Eight scalars,
    those past BT_PAGES 0; page_ids_spread turns them into the tile's per-key ids where they are used,
    so that a tile's ids can be loaded an iteration ahead without waiting for them there."""
    p0 = start // PAGE_SIZE
    i0 = tl.load(bt_row + p0, mask=p0 < bt_width, other=0)
    i1 = i0 * 0
    i2 = i1
    i3 = i1
    i4 = i1
    i5 = i1
    i6 = i1
    i7 = i1
    if BT_PAGES > 1:
        i1 = tl.load(bt_row + p0 + 1, mask=p0 + 1 < bt_width, other=0)
    if BT_PAGES > 2:
        i2 = tl.load(bt_row + p0 + 2, mask=p0 + 2 < bt_width, other=0)
        i3 = tl.load(bt_row + p0 + 3, mask=p0 + 3 < bt_width, other=0)
    if BT_PAGES > 4:
        i4 = tl.load(bt_row + p0 + 4, mask=p0 + 4 < bt_width, other=0)
        i5 = tl.load(bt_row + p0 + 5, mask=p0 + 5 < bt_width, other=0)
        i6 = tl.load(bt_row + p0 + 6, mask=p0 + 6 < bt_width, other=0)
        i7 = tl.load(bt_row + p0 + 7, mask=p0 + 7 < bt_width, other=0)
    return i0, i1, i2, i3, i4, i5, i6, i7


@triton.jit
def page_ids_spread(i0, i1, i2, i3, i4, i5, i6, i7, offs_n, PAGE_SIZE: tl.constexpr, BT_PAGES: tl.constexpr):
    """page_ids_load's scalars -> the block id of each key offs_n of the tile (int64)."""
    blk = i0.to(tl.int64) + tl.zeros_like(offs_n).to(tl.int64)
    if BT_PAGES > 1:
        blk = tl.where(offs_n >= PAGE_SIZE, i1.to(tl.int64), blk)
    if BT_PAGES > 2:
        blk = tl.where(offs_n >= 2 * PAGE_SIZE, i2.to(tl.int64), blk)
        blk = tl.where(offs_n >= 3 * PAGE_SIZE, i3.to(tl.int64), blk)
    if BT_PAGES > 4:
        blk = tl.where(offs_n >= 4 * PAGE_SIZE, i4.to(tl.int64), blk)
        blk = tl.where(offs_n >= 5 * PAGE_SIZE, i5.to(tl.int64), blk)
        blk = tl.where(offs_n >= 6 * PAGE_SIZE, i6.to(tl.int64), blk)
        blk = tl.where(offs_n >= 7 * PAGE_SIZE, i7.to(tl.int64), blk)
    return blk


def page_ids_per_tile(block_n: int, page: int) -> int:
    """page_ids_load's BT_PAGES for BLOCK_N-key tiles over pages of `page` keys: the pages a tile spans
    when tiles never straddle a page edge (one page holds whole tiles, or a tile whole pages: 2, 4 or
    8 of them), else 0 (one gathered id per key)."""
    if page % block_n == 0:
        return 1
    if block_n % page == 0 and block_n // page in (2, 4, 8):
        return block_n // page
    return 0


@triton.jit
def _paged_inner(acc, l_i, m_i, v_run, q, KC, VC, bt_row, kv_off_k, kv_off_v,
                 stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                 lo, hi, seq_len, ctx, q_row, qpos, row_ok, TREE, stride_tree, qk_scale, offs_n, offs_d, bt_width,
                 ks_base, vs_base, stride_sb, tree_pos, key_lo,
                 MASKED: tl.constexpr, USE_TREE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PREC: tl.constexpr, BT_AHEAD: tl.constexpr,
                 QUANT: tl.constexpr, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
                 F16_CODES: tl.constexpr = False, BT_PAGES: tl.constexpr = 0):
    # v_run: acc's unit with F16_CODES (the last tile's largest V scale, as in flash_decoding's kernel)
    if BT_AHEAD:
        # a tile's block ids are loaded one iteration ahead (masked by the table's width only): its K/V
        # copies then depend on no load of their own iteration, and Triton's pipeliner gives them
        # num_stages - 1 shared-memory buffers instead of one (flash_decoding's split kernel does the same).
        # BT_PAGES > 0: one load per page of the tile, not one per key (page_ids_load)
        if BT_PAGES > 0:
            a0, a1, a2, a3, a4, a5, a6, a7 = page_ids_load(bt_row, lo, bt_width, PAGE_SIZE, BT_PAGES)
        else:
            ja = lo + offs_n
            blk_a = tl.load(bt_row + ja // PAGE_SIZE, mask=ja // PAGE_SIZE < bt_width, other=0)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        j = start_n + offs_n
        if MASKED:
            kv_ok = j < seq_len
            if WINDOW > 0:  # keys before every row's window are not loaded (nor their given-back blocks)
                kv_ok = kv_ok & (j >= key_lo)
        if BT_AHEAD and BT_PAGES > 0:
            blk = page_ids_spread(a0, a1, a2, a3, a4, a5, a6, a7, offs_n, PAGE_SIZE, BT_PAGES)
            a0, a1, a2, a3, a4, a5, a6, a7 = page_ids_load(bt_row, start_n + BLOCK_N, bt_width, PAGE_SIZE, BT_PAGES)
        elif BT_AHEAD:
            blk = blk_a.to(tl.int64)
            jn = j + BLOCK_N
            blk_a = tl.load(bt_row + jn // PAGE_SIZE, mask=jn // PAGE_SIZE < bt_width, other=0)
        elif MASKED:
            blk = tl.load(bt_row + j // PAGE_SIZE, mask=kv_ok, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + j // PAGE_SIZE).to(tl.int64)
        if BT_AHEAD and BT_PAGES > 0 and PAGE_SIZE <= BLOCK_N:
            in_page = offs_n % PAGE_SIZE  # tiles start on a page edge: the same offsets every tile
        else:
            in_page = j % PAGE_SIZE
        k_ptrs = KC + blk[:, None] * stride_kcb + in_page[:, None] * stride_kcs + kv_off_k + offs_d[None, :]
        v_ptrs = VC + blk[:, None] * stride_vcb + in_page[:, None] * stride_vcs + kv_off_v + offs_d[None, :]
        if MASKED:
            if BLOCK_D != HEAD_DIM:
                ld_mask = kv_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
            else:
                ld_mask = kv_ok[:, None]
            k = tl.load(k_ptrs, mask=ld_mask, other=0.0)
        else:
            if BLOCK_D != HEAD_DIM:
                k = tl.load(k_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            else:
                k = tl.load(k_ptrs)
        if QUANT:  # codes (exact in q's dtype) into the dots; the scales multiply scores and weights
            s_at = blk * stride_sb + in_page
            if MASKED:
                k_sc = tl.load(ks_base + s_at, mask=kv_ok, other=0.0)
                v_sc = tl.load(vs_base + s_at, mask=kv_ok, other=0.0)
            else:
                k_sc = tl.load(ks_base + s_at)
                v_sc = tl.load(vs_base + s_at)
            k = k.to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        if QUANT:
            qk = qk * k_sc[None, :]
        if MASKED:
            ok = kv_ok[None, :]
            if USE_TREE:
                t = j - ctx
                in_tree = (t >= 0) & kv_ok
                tm = tl.load(TREE + q_row[:, None] * stride_tree + t[None, :],
                             mask=row_ok[:, None] & in_tree[None, :], other=0)
                ok = ok & ((t[None, :] < 0) | (tm != 0))
                if WINDOW > 0:  # a tree key sits at its node's position (tree_pos: the sequence's positions)
                    kpos = tl.where(t >= 0, tl.load(tree_pos + t, mask=in_tree, other=0).to(tl.int32), j)
                    ok = ok & (kpos[None, :] > qpos[:, None] - WINDOW)
            else:
                ok = ok & (j[None, :] <= qpos[:, None])
                if WINDOW > 0:
                    ok = ok & (j[None, :] > qpos[:, None] - WINDOW)
            qk = tl.where(ok, scale_scores(qk, qk_scale, SOFTCAP), float("-inf"))
        else:
            qk = scale_scores(qk, qk_scale, SOFTCAP)
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_ptrs, mask=ld_mask, other=0.0)
        else:
            if BLOCK_D != HEAD_DIM:
                v = tl.load(v_ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
            else:
                v = tl.load(v_ptrs)
        if QUANT and F16_CODES:
            acc, v_run = pv_f16_weights(acc, alpha, p, v.to(q.dtype), v_sc, v_run, PREC)
        elif QUANT:
            acc = acc * alpha[:, None]
            v = v.to(q.dtype)
            acc = tl.dot((p * v_sc[None, :]).to(v.dtype), v, acc, input_precision=PREC)
        else:
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_ij
    return acc, l_i, m_i, v_run


# The block-table width (stride_bt) and the tree-mask stride change from step to step: specializing
# on them (divisibility by 16) would compile new variants in the middle of serving.
@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_tree", "bt_width"])
def _paged_prefill_kernel(
    Q, KC, VC, O, PO, PLSE, BT, SEQ_LENS, QSL, TILE_SEQ, TILE_QB, TREE,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_bt, stride_tree, bt_width,
    qk_scale, num_splits,
    KS, VS, stride_sb, stride_sh, POS,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    USE_TREE: tl.constexpr, SPLIT: tl.constexpr, PREC: tl.constexpr, BT_AHEAD: tl.constexpr = 0,
    QUANT: tl.constexpr = False, QMAX: tl.constexpr = 1.0, CODE_INT: tl.constexpr = False,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0, F16_CODES: tl.constexpr = False,
    BT_PAGES: tl.constexpr = 0,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(TILE_SEQ + tile)
    qb = tl.load(TILE_QB + tile)
    q_start = tl.load(QSL + seq)
    q_len = tl.load(QSL + seq + 1) - q_start
    seq_len = tl.load(SEQ_LENS + seq)
    ctx = seq_len - q_len

    r = tl.arange(0, BLOCK_M)
    qi = qb * (BLOCK_M // GROUP_PAD) + r // GROUP_PAD
    g = r % GROUP_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    q_row = (q_start + qi).to(tl.int64)
    if USE_TREE and WINDOW > 0:  # a tree's queries sit at their nodes' positions
        qpos = tl.load(POS + q_row, mask=row_ok, other=0).to(tl.int32)
    else:
        qpos = ctx + qi
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if QUANT and F16_CODES:
        # the codes widen to float16 (flash_decoding.f16_codes): q meets them there, clamped to its range
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    bt_row = BT + seq.to(tl.int64) * stride_bt
    kv_off_k = kvh * stride_kch
    kv_off_v = kvh * stride_vch
    if QUANT:
        ks_base = KS + kvh * stride_sh
        vs_base = VS + kvh * stride_sh
    else:
        ks_base = KS
        vs_base = VS
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    v_run = 1.0
    # keys every row of the tile may see: all context keys (tree), or every key left of the tile's
    # first query (causal)
    if USE_TREE:
        shared_end = ctx
        kv_end = seq_len
    else:
        shared_end = ctx + qb * (BLOCK_M // GROUP_PAD)
        kv_end = tl.minimum(seq_len, shared_end + BLOCK_M // GROUP_PAD)
    full = shared_end - shared_end % BLOCK_N
    if USE_TREE and WINDOW > 0:
        tree_pos = POS + q_start  # the tree keys' positions
    else:
        tree_pos = q_start  # unused
    if WINDOW > 0:
        # sliding window: keys before start are out of every row's window (skipped), keys before edge
        # out of some rows' (masked); qpos ranges over [qmin, qmax] in the tile
        qmin = tl.min(tl.where(row_ok, qpos, 2147483647), 0)
        qmax = tl.max(tl.where(row_ok, qpos, 0), 0)
        key_lo = qmin - WINDOW + 1
        start = tl.minimum(tl.maximum(key_lo, 0), kv_end) // BLOCK_N * BLOCK_N
        edge = tl.cdiv(tl.maximum(qmax - WINDOW + 1, 0), BLOCK_N) * BLOCK_N
    else:
        key_lo = 0
        start = 0
        edge = 0
    # Flash-Decoding over the keys with SPLIT: this program takes one BLOCK_N-aligned chunk of [start, kv_end)
    lo, hi = split_range(kv_end, split, num_splits, BLOCK_N, SPLIT, start)
    if WINDOW > 0:  # the window's edge, masked
        acc, l_i, m_i, v_run = _paged_inner(acc, l_i, m_i, v_run, q, KC, VC, bt_row, kv_off_k, kv_off_v,
                                     stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                     lo, tl.minimum(tl.minimum(edge, full), hi), seq_len, ctx, q_row, qpos, row_ok,
                                     TREE, stride_tree, qk_scale, offs_n, offs_d, bt_width, ks_base, vs_base,
                                     stride_sb, tree_pos, key_lo,
                                     True, USE_TREE, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PREC, BT_AHEAD, QUANT,
                                     WINDOW, SOFTCAP, F16_CODES, BT_PAGES)
        lo = tl.maximum(lo, tl.minimum(edge, full))
    acc, l_i, m_i, v_run = _paged_inner(acc, l_i, m_i, v_run, q, KC, VC, bt_row, kv_off_k, kv_off_v,
                                 stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                 lo, tl.minimum(full, hi), seq_len, ctx, q_row, qpos, row_ok, TREE, stride_tree,
                                 qk_scale, offs_n, offs_d, bt_width, ks_base, vs_base, stride_sb, tree_pos, key_lo,
                                 False, USE_TREE, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PREC, BT_AHEAD, QUANT, 0, SOFTCAP,
                                 F16_CODES, BT_PAGES)
    acc, l_i, m_i, v_run = _paged_inner(acc, l_i, m_i, v_run, q, KC, VC, bt_row, kv_off_k, kv_off_v,
                                 stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                                 tl.maximum(full, lo), hi, seq_len, ctx, q_row, qpos, row_ok, TREE, stride_tree,
                                 qk_scale, offs_n, offs_d, bt_width, ks_base, vs_base, stride_sb, tree_pos, key_lo,
                                 True, USE_TREE, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PREC, BT_AHEAD, QUANT, WINDOW, SOFTCAP,
                                 F16_CODES, BT_PAGES)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if QUANT and F16_CODES:
        acc = acc * (v_run / l_safe)[:, None]
    else:
        acc = acc / l_safe[:, None]
    ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if SPLIT:
        # partials PO [T, Hq, num_splits, D] fp32 and PLSE [T, Hq, num_splits] (log2 domain), combined
        # by flash_decoding's combine kernel
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        prow = (q_row * (GROUP * tl.num_programs(1)) + head) * num_splits + split
        tl.store(PO + prow[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=ok)
        tl.store(PLSE + prow, lse, mask=row_ok)
    else:
        o_ptrs = O + q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=ok)


_paged_prefill_kernel = fast_launch(_paged_prefill_kernel)  # host launches via the cached CompiledKernel


@functools.lru_cache(maxsize=256)
def prefill_config(head_dim: int, group: int, max_query_len: int, dtype: torch.dtype, device: torch.device,
                   kv_dtype: Optional[torch.dtype] = None) -> dict:
    """BLOCK_M (= queries per tile x padded group), BLOCK_N, num_warps, num_stages for the paged kernel
    (kv_dtype: a quantized cache's code dtype), BT_AHEAD (a tile's block ids loaded one iteration ahead: see
    flash_decoding.decode_config) and BT_PAGES (one block-id load per page of a tile instead of one per key,
    where tiles and pages line up: page_ids_per_tile; head_dim > 64). Cached: callers copy before changing it."""
    group_pad = next_pow2(group)
    rows = next_pow2(max(1, max_query_len) * group_pad)
    d = next_pow2(head_dim)
    # block ids one per page above head_dim 64 (run 51, H100: 1.05-1.18x on llama-3-8b heads' mixed steps,
    # chunks and long chunks, bf16 and quantized; W-attn-prefill's paged column 1.09-1.11x at D 128, and
    # 1.09x at D 256). At D 64 it was mixed: 1.02-1.08x on smollm2's steps, but 0.81-0.83x on 16 x 2048
    # causal prefills with 128-row tiles at 8 warps (4 warps won that back and lost 8% on a mixed step)
    pages = d > 64
    if device.type != "cuda":
        return dict(BLOCK_M=max(16, min(rows, 32), group_pad), BLOCK_N=16, num_warps=4, num_stages=1, BT_AHEAD=1,
                    BT_PAGES=pages)
    if d > 128 and dtype != torch.float32 and kv_dtype is None and rows >= 128 and has_large_smem(device):
        # head_dim 256 (Gemma) prefill chunks: 128x64 tiles, 8 warps, 2 stages (H100,
        # scripts/d256_probe.py: 399 / 376 TFLOP/s against 326 / 315 for 64x32 w4 s2)
        return dict(BLOCK_M=max(128, group_pad), BLOCK_N=64, num_warps=8, num_stages=2, BT_AHEAD=1, BT_PAGES=pages)
    big = dtype == torch.float32 or d > 128
    cap = 64 if big else 128
    block_m = max(16, min(rows, cap), group_pad)
    if big:
        return dict(BLOCK_M=block_m, BLOCK_N=32, num_warps=4, num_stages=1 if d > 128 and dtype == torch.float32 else 2,
                    BT_AHEAD=1, BT_PAGES=pages)
    if kv_dtype is not None and kv_dtype.itemsize == 1:
        # a quantized cache (kv_dtype: its codes): 64x64 tiles, 4 warps, 2 stages. H100, llama-3-8b
        # heads (scripts/kvq_paged_probe.py): int8 four 1024-token chunks 513 -> 469 us, a mixed step
        # of 240 decodes + a 1024-token chunk 744 -> 409 us against the bf16 cache's 128x64 w8 s3
        # (e4m3 573 -> 568, 822 -> 481); the bf16 cache keeps 128x64 (296 vs 322 us on the chunks)
        return dict(BLOCK_M=max(16, min(rows, 64), group_pad), BLOCK_N=64, num_warps=4, num_stages=2, BT_AHEAD=1,
                    BT_PAGES=pages)
    if block_m >= 128:  # H100 sweep (scripts/paged_ahead_probe.py): 128x64 w8 s3 with the block ids ahead
        return dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=8, num_stages=3, BT_AHEAD=1, BT_PAGES=pages)
    return dict(BLOCK_M=block_m, BLOCK_N=64, num_warps=4, num_stages=3, BT_AHEAD=1, BT_PAGES=pages)


def build_tiles(
    query_lens: Sequence[int], seq_lens: Sequence[int], queries_per_tile: int, device: torch.device,
    first_seq: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-side work list: (tile_seq, tile_qblock), int32 [num_tiles] on device, heaviest tile first
    (a tile's work is the number of keys it reads). Sequences before first_seq get no tiles (their
    rows are left to another kernel)."""
    work = []
    for i, (ql, sl) in enumerate(zip(query_lens, seq_lens)):
        if i < first_seq:
            continue
        ctx = sl - ql
        for qb in range((ql + queries_per_tile - 1) // queries_per_tile):
            work.append((min(sl, ctx + (qb + 1) * queries_per_tile), i, qb))
    work.sort(key=lambda w: -w[0])
    t = torch.tensor([[w[1] for w in work], [w[2] for w in work]], dtype=torch.int32)
    t = to_device(t, device)
    return t[0], t[1]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    query_lens_cpu: Sequence[int],
    seq_lens_cpu: Sequence[int],
    tree_mask: Optional[torch.Tensor] = None,
    tiles: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    config: Optional[dict] = None,
    num_splits: int = 1,
    kv_scales: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    window: Optional[int] = None,
    positions: Optional[torch.Tensor] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Attention of the new queries over the paged cache (their K/V already stored; with kv_scales
    (k_scale, v_scale) float32 [num_blocks, Hkv, block_size], a quantized cache of int8 / e4m3 codes).

    q: [T, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D]; query_start_loc int32 [S+1];
    seq_lens int32 [S]; block_tables int32 [S, W]; tree_mask bool/uint8 [T, >= max_query_len] or None
    (causal). query_lens_cpu/seq_lens_cpu: host lists (tile sizing, no sync). tiles: a work list from
    :func:`build_tiles` for the config's queries per tile (built here when None). num_splits > 1:
    each (tile, KV head) splits its keys over that many programs whose partial outputs are combined
    by log-sum-exp (Flash-Decoding for few queries over a long context: speculative verify steps).
    window: a sliding-window layer's (pageflash.layers.attention's module doc); with a tree mask it
    needs ``positions`` [T] (int32 / int64), the new tokens' positions. softcap: scores s ->
    softcap * tanh(s / softcap) (Gemma 2). Returns [T, Hq, D].
    """
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged_attention: q must be [T, Hq, D] and caches [num_blocks, block_size, Hkv, D], got "
            f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    t, hq, d = q.shape
    _, page, hkv, dk = k_cache.shape
    if dk != d or hq % hkv:
        raise ValueError(f"paged_attention: q heads/dim {(hq, d)} incompatible with cache heads/dim {(hkv, dk)}")
    qargs, qconst = kv_scale_args(k_cache, v_cache, kv_scales, "paged_attention")
    if not qconst["QUANT"] and not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"paged_attention: dtypes differ: q {q.dtype}, caches {k_cache.dtype}/{v_cache.dtype}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"paged_attention: q must be float16/bfloat16/float32, got {q.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_attention: q and caches must be contiguous in head_dim")
    s = len(seq_lens_cpu)
    if len(query_lens_cpu) != s or query_start_loc.shape != (s + 1,) or seq_lens.shape != (s,):
        raise ValueError(
            f"paged_attention: {s} sequences but query_start_loc {tuple(query_start_loc.shape)}, seq_lens "
            f"{tuple(seq_lens.shape)}, {len(query_lens_cpu)} query lengths"
        )
    for name, x in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens), ("block_tables", block_tables)):
        if x.dtype != torch.int32:
            raise TypeError(f"paged_attention: {name} must be int32, got {x.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] < s or block_tables.stride(1) != 1:
        raise ValueError(f"paged_attention: block_tables must be [S, W] row-major, got {tuple(block_tables.shape)}")
    o = torch.empty_like(q)
    if t == 0 or s == 0:
        return o
    group = hq // hkv
    cfg = dict(prefill_config(d, group, max(query_lens_cpu), q.dtype, q.device,
                              k_cache.dtype if qconst["QUANT"] else None))
    cfg.update(config or {})
    group_pad = next_pow2(group)
    if cfg["BLOCK_M"] % group_pad:
        raise ValueError(f"paged_attention: BLOCK_M {cfg['BLOCK_M']} must be a multiple of the padded group")
    if tiles is None:
        tiles = build_tiles(query_lens_cpu, seq_lens_cpu, cfg["BLOCK_M"] // group_pad, q.device)
    tile_seq, tile_qb = tiles
    if tile_seq.numel() == 0:
        return o
    if tree_mask is not None:
        if tree_mask.dim() != 2 or tree_mask.shape[0] != t or tree_mask.shape[1] < max(query_lens_cpu):
            raise ValueError(
                f"paged_attention: tree_mask must be [T={t}, >= {max(query_lens_cpu)}], got {tuple(tree_mask.shape)}"
            )
        if tree_mask.dtype == torch.bool:
            tree_mask = tree_mask.view(torch.uint8)
        if tree_mask.stride(1) != 1:
            tree_mask = tree_mask.contiguous()
    if num_splits < 1:
        raise ValueError(f"paged_attention: num_splits must be >= 1, got {num_splits}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"paged_attention: window must be a positive int or None, got {window!r}")
    pos = None
    if window is not None and tree_mask is not None:
        if positions is None or positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"paged_attention: a sliding window over a tree mask needs positions [{t}] int32/int64, "
                             f"got {None if positions is None else (tuple(positions.shape), positions.dtype)}")
        pos = positions.contiguous()
    split = num_splits > 1
    if split:
        po = torch.empty((t, hq, num_splits, d), device=q.device, dtype=torch.float32)
        plse = torch.empty((t, hq, num_splits), device=q.device, dtype=torch.float32)
    else:
        po = plse = None  # unused without SPLIT (None: a constexpr to Triton, nothing to bind per launch)
    _paged_prefill_kernel[(tile_seq.numel(), hkv, num_splits)](
        q, k_cache, v_cache, o, po, plse, block_tables, seq_lens, query_start_loc, tile_seq, tile_qb,
        tree_mask,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), tree_mask.stride(0) if tree_mask is not None else 0, block_tables.shape[1],
        scale * LOG2E, num_splits, *qargs, pos,
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], PAGE_SIZE=page,
        USE_TREE=tree_mask is not None, SPLIT=split, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        BT_AHEAD=cfg.get("BT_AHEAD", 0), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **qconst,
        WINDOW=window or 0, SOFTCAP=softcap_arg(softcap),
        F16_CODES=f16_codes(q.dtype, k_cache.dtype if qconst["QUANT"] else None, cfg.get("F16_CODES")),
        # per-page ids come with the ids loaded ahead (BT_AHEAD), which every config sets
        BT_PAGES=page_ids_per_tile(cfg["BLOCK_N"], page) if cfg.get("BT_PAGES") and cfg.get("BT_AHEAD") else 0,
    )
    if split:
        from pageflash.kernels.flash_decoding import combine_partials

        # rows no tile wrote (padding rows of a CUDA-graph step) get lse -inf from every split: a zero output
        combine_partials(o, po, plse)
    return o
