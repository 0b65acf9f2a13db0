"""Head-grouped decode: one program reads HPP KV heads of each page it visits, so a page's address
translation is requested by Hkv / HPP programs instead of Hkv.

Why: `scripts/decode_locality_probe.py` found that shuffling pages only within 2 MB regions costs
almost nothing, while shuffling them over the whole pool costs 1-4%: address translation (TLB reach),
not DRAM order. Today each of the Hkv programs of a split reads its head's 256-byte pieces of every
page, so every page's translation is looked up Hkv times (on different SMs). Here program
(split, head group, sequence) takes whole tiles of PAGES pages for HPP heads: its K tile is
[keys x HPP heads, D] with the heads of one slot adjacent in memory (HPP x 256 contiguous bytes),
and the HPP x G query heads form one Q tile whose rows attend only to their own head's columns
(block-diagonal mask; the masked MMA work is cheap next to the bytes).

Prediction: if translation is the cost, HPP 4-8 closes most of the shuffled-vs-in-order gap (1-4%);
the extra MMA/softmax work (x HPP) must stay hidden under the loads.
Usage: python scripts/decode_headgroup_probe.py [--shapes 1x32768 ...]   (CPU: --check under
TRITON_INTERPRET=1)
"""

import argparse

import torch
import triton
import triton.language as tl

import pageflash.kernels.flash_decoding as fd
from pageflash.kernels.host_math import next_pow2


@triton.jit
def _hg_split_kernel(
    Q, KC, VC, O, PO, PLSE, BT, SEQ_LENS,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt, bt_width, qk_scale, num_splits,
    GROUP: tl.constexpr, HPP: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, PAGES: tl.constexpr, SPLIT: tl.constexpr,
):
    split = tl.program_id(0)
    hg = tl.program_id(1)
    b = tl.program_id(2)
    b64 = b.to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b)
    TILE: tl.constexpr = PAGE * PAGES  # keys per tile
    N: tl.constexpr = TILE * HPP  # columns: (key, head) with the heads of one key adjacent
    if SPLIT:
        eff = tl.minimum(tl.maximum(tl.cdiv(seq_len, TILE), 1), num_splits)
        lo = split * TILE
        step = num_splits * TILE
    else:
        eff = 1
        lo = 0
        step = TILE
    live = split < eff

    offs_r = tl.arange(0, ROWS)
    offs_c = tl.arange(0, N)
    offs_d = tl.arange(0, HEAD_DIM)
    r_ok = offs_r < HPP * GROUP
    head_q = hg * HPP * GROUP + offs_r  # query head of each row
    kvh_r = offs_r // GROUP  # its KV head within the group
    kvh_c = offs_c % HPP  # each column's KV head within the group
    key_c = offs_c // HPP  # each column's key within the tile
    same = kvh_r[:, None] == kvh_c[None, :]
    q = tl.load(Q + b64 * stride_qb + head_q[:, None] * stride_qh + offs_d[None, :], mask=r_ok[:, None], other=0.0)
    bt_row = BT + b64 * stride_bt
    k_head = (hg * HPP + kvh_c).to(tl.int64)
    k_col = k_head * stride_kch
    v_col = k_head * stride_vch

    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    ja = lo + key_c
    blk_a = tl.load(bt_row + ja // PAGE, mask=ja // PAGE < bt_width, other=0)
    for start in range(lo, seq_len, step):
        j = start + key_c
        kv_ok = j < seq_len
        blk = blk_a.to(tl.int64)
        jn = j + step
        blk_a = tl.load(bt_row + jn // PAGE, mask=jn // PAGE < bt_width, other=0)
        slot = (j % PAGE).to(tl.int64)
        k = tl.load(KC + (blk * stride_kcb + slot * stride_kcs + k_col)[:, None] + offs_d[None, :],
                    mask=kv_ok[:, None], other=0.0)
        v = tl.load(VC + (blk * stride_vcb + slot * stride_vcs + v_col)[:, None] + offs_d[None, :],
                    mask=kv_ok[:, None], other=0.0)
        qk = tl.dot(q, tl.trans(k))
        qk = tl.where(same & kv_ok[None, :], qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    live_rows = r_ok & ((tl.zeros([ROWS], dtype=tl.int32) + live.to(tl.int32)) > 0)
    o_ptr = O + b64 * stride_ob + head_q[:, None] * stride_oh + offs_d[None, :]
    if not SPLIT:  # (a constexpr branch: PO / PLSE are None then)
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=live_rows[:, None])
    elif eff == 1:
        tl.store(o_ptr, out.to(O.dtype.element_ty), mask=live_rows[:, None])
    else:
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        hq = GROUP * HPP * tl.num_programs(1)
        row = (b64 * hq + head_q) * num_splits + split
        tl.store(PO + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=live_rows[:, None])
        tl.store(PLSE + row, lse, mask=live_rows)


def hg_decode(q, kc, vc, bt, sl, scale, num_splits, hpp, pages, num_warps=4, num_stages=2):
    b, hq, d = q.shape
    _, page, hkv, _ = kc.shape
    group = hq // hkv
    o = torch.empty_like(q)
    if num_splits > 1:
        po = torch.empty((b, hq, num_splits, d), device=q.device, dtype=torch.float32)
        plse = torch.empty((b, hq, num_splits), device=q.device, dtype=torch.float32)
    else:
        po = plse = None
    ks, vs = kc.stride(), vc.stride()
    _hg_split_kernel[(num_splits, hkv // hpp, b)](
        q, kc, vc, o, po, plse, bt, sl, q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], bt.stride(0), bt.shape[1], scale * fd.LOG2E, num_splits,
        GROUP=group, HPP=hpp, ROWS=max(16, next_pow2(group * hpp)), HEAD_DIM=d, PAGE=page, PAGES=pages,
        SPLIT=num_splits > 1, num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        fd.combine_partials(o, po, plse, lens=(sl, page * pages), strided=True,
                            config=dict(BLOCK_DC=32, EAGER=True, num_warps=2))
    return o


def check(device, dtype):
    torch.manual_seed(0)
    bad = []
    for hq, hkv, d, page in [(8, 4, 32, 8), (32, 8, 64, 16)]:
        for b, L, sp in [(3, 100, 1), (2, 77, 4), (1, 300, 7), (4, 17, 3)]:
            nb = (L + page - 1) // page
            kc = torch.randn(b * nb + 2, page, hkv, d, device=device, dtype=dtype)
            vc = torch.randn_like(kc)
            bt = torch.randperm(b * nb + 2, device=device)[: b * nb].to(torch.int32).view(b, nb)
            sl = torch.randint(1, L + 1, (b,), device=device, dtype=torch.int32)
            sl[0] = L
            q = torch.randn(b, hq, d, device=device, dtype=dtype)
            ref = fd.flash_decode_ref(q, kc, vc, bt, sl, d ** -0.5).float()
            for hpp in (1, 2, 4, 8):
                if hkv % hpp:
                    continue
                for pages in (1, 2):
                    if hpp * page * pages < 16:  # tl.dot needs K >= 16 (the P @ V product's inner size)
                        continue
                    out = hg_decode(q, kc, vc, bt, sl, d ** -0.5, sp, hpp, pages).float()
                    err = (out - ref).abs().max().item()
                    if not err < (2e-2 if dtype != torch.float32 else 1e-4):
                        bad.append((hq, hkv, d, page, b, L, sp, hpp, pages, err))
    print("check:", "all match the reference" if not bad else f"MISMATCH {bad}", flush=True)
    return not bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1x32768", "8x8192", "64x2048", "1x131072", "256x1024"])
    ap.add_argument("--check", action="store_true", help="correctness only (CPU: TRITON_INTERPRET=1)")
    a = ap.parse_args()
    if a.check or not torch.cuda.is_available():
        raise SystemExit(0 if check("cuda" if torch.cuda.is_available() else "cpu", torch.float32) else 1)
    from triton.testing import do_bench_cudagraph

    from pageflash.bench.kernels import DECODE_HEADS, decode_case, pages_in_order

    if not check("cuda", torch.bfloat16):
        raise SystemExit(1)
    hq, hkv, d = DECODE_HEADS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = [  # hpp, pages, warps, stages, programs per SM
        (2, 2, 4, 2, 4), (4, 1, 4, 2, 4), (4, 2, 4, 2, 3), (4, 2, 8, 2, 3), (8, 1, 4, 2, 3), (8, 1, 8, 2, 3),
        (8, 1, 8, 2, 2), (4, 1, 4, 3, 3),
    ]
    summary = []
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        q, kc, vc, bt, sl = decode_case(b, L)
        bt_seq = pages_in_order(bt)
        torch.cuda.synchronize()
        res = {}

        def timed(fn):
            fn()
            torch.cuda.synchronize()
            return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3

        kk = kc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
        vv = vc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
        q4 = q.view(b, hq, 1, d)
        res["cudnn"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True))
        del kk, vv
        sp0 = fd.choose_num_splits(b, hkv, L, sms)
        for name, table in (("", bt), ("in order ", bt_seq)):
            res[f"{name}ours sp{sp0}"] = timed(lambda: fd.flash_decode(q, kc, vc, table, sl, d ** -0.5, num_splits=sp0))
        for hpp, pages, w, s, per_sm in variants:
            progs = b * hkv // hpp
            sps = {fd.choose_num_splits(b, hkv // hpp, L, sms, slots_per_sm=per_sm, min_chunk=16 * pages)}
            if progs < 2 * sms:
                sps |= {max(1, (per_sm * sms) // progs // 2)}
            for sp in sorted(sps):
                key = f"hpp{hpp} pages{pages} w{w} s{s} sp{sp}"
                try:
                    res[key] = timed(lambda: hg_decode(q, kc, vc, bt, sl, d ** -0.5, sp, hpp, pages, w, s))
                except Exception as e:
                    print(shape, key, "failed:", type(e).__name__, str(e)[:120], flush=True)
        best = min((v, k) for k, v in res.items() if k.startswith("hpp"))
        hpp, pages, w, s, sp = [int(t[len(p):]) for t, p in zip(best[1].split(), ("hpp", "pages", "w", "s", "sp"))]
        res[f"in order {best[1]}"] = timed(lambda: hg_decode(q, kc, vc, bt_seq, sl, d ** -0.5, sp, hpp, pages, w, s))
        print(f"\n== {shape}", flush=True)
        for k, v in sorted(res.items(), key=lambda kv: kv[1]):
            print(f"  {k:<40}{v:>8.1f} us   cudnn/this {res['cudnn'] / v:5.3f}", flush=True)
        summary.append((shape, res["cudnn"], res[f"ours sp{sp0}"], res[f"in order ours sp{sp0}"], best))
        del q, kc, vc, bt, bt_seq
        torch.cuda.empty_cache()
    print("\nshape      cudnn    ours  ours-in-order  best head-grouped (shuffled)")
    for shape, c, o, oi, (bv, bk) in summary:
        print(f"{shape:<10}{c:>6.1f}{o:>8.1f}{oi:>15.1f}{bv:>8.1f}  {bk}")


if __name__ == "__main__":
    main()
