"""Persistent unsplit decode: do waves of programs cost a bubble each?

Unsplit decode grids (B x Hkv >= 2 x SMs: B64 L2k, B256 L1k at 8 KV heads) run B x Hkv programs of
equal length, 4 per SM: B256 is 2048 programs, ~3.9 waves of 528. When a wave's programs end together,
each new program first loads seq_len, q and its first block ids, and only then its first K/V tile:
two memory latencies (~1-2 us) in which its SM asks DRAM for nothing. Here a persistent variant runs
P programs (P <= 4 x SMs, items / P whole), program p taking items p, p + P, ... (item = b * Hkv + kvh,
so the heads of one sequence run side by side, as in the grid); with PREFETCH it loads the next item's
seq_len, q and first block ids while it streams the current one, so that its K/V loads never wait.

Prediction: if the bubble is ~1-1.5 us per wave, B256 L1k (3 wave changes) gains 3-4.5 us (~1%) and
B64 L4k / B64 L2k (one wave) gain nothing; time per byte of B256 L1k vs B64 L4k (same bytes) shows the
bubble in the grid kernel itself.

Usage: python scripts/decode_persistent_probe.py [--shapes 256x1024 ...] [--rounds 3]
       TRITON_INTERPRET=1 python scripts/decode_persistent_probe.py --check   (CPU, small shapes)
"""

import argparse
import statistics

import torch
import triton
import triton.language as tl

import pageflash.kernels.flash_decoding as fd
from pageflash.kernels.host_math import next_pow2

LOG2E = 1.4426950408889634


@triton.jit
def _persist_kernel(
    Q, KC, VC, O, BT, SEQ_LENS,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt, bt_width, qk_scale, n_items,
    HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, PREFETCH: tl.constexpr, PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    h_ok = offs_h < GROUP
    # the first item's inputs (PREFETCH: each later item's are loaded during the previous one)
    b0 = pid // HKV
    seq_len = tl.load(SEQ_LENS + b0)
    q = tl.load(Q + b0.to(tl.int64) * stride_qb + ((pid % HKV) * GROUP + offs_h)[:, None] * stride_qh
                + offs_d[None, :], mask=h_ok[:, None], other=0.0)
    blk_a = tl.load(BT + b0.to(tl.int64) * stride_bt + offs_n // PAGE_SIZE, mask=offs_n // PAGE_SIZE < bt_width,
                    other=0)
    for it in range(pid, n_items, nprog):
        b = it // HKV
        kvh = it % HKV
        b64 = b.to(tl.int64)
        if PREFETCH:
            nxt = it + nprog
            nb = tl.where(nxt < n_items, nxt // HKV, b).to(tl.int64)
            nh = tl.where(nxt < n_items, nxt % HKV, kvh)
            n_len = tl.load(SEQ_LENS + nb)
            n_q = tl.load(Q + nb * stride_qb + (nh * GROUP + offs_h)[:, None] * stride_qh + offs_d[None, :],
                          mask=h_ok[:, None], other=0.0)
            n_blk = tl.load(BT + nb * stride_bt + offs_n // PAGE_SIZE, mask=offs_n // PAGE_SIZE < bt_width, other=0)
        else:
            seq_len = tl.load(SEQ_LENS + b)
            q = tl.load(Q + b64 * stride_qb + (kvh * GROUP + offs_h)[:, None] * stride_qh + offs_d[None, :],
                        mask=h_ok[:, None], other=0.0)
            blk_a = tl.load(BT + b64 * stride_bt + offs_n // PAGE_SIZE, mask=offs_n // PAGE_SIZE < bt_width,
                            other=0)
        bt_row = BT + b64 * stride_bt
        k_base = KC + kvh * stride_kch
        v_base = VC + kvh * stride_vch
        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
        for start_n in range(0, seq_len, BLOCK_N):
            j = start_n + offs_n
            kv_ok = j < seq_len
            blk = blk_a.to(tl.int64)
            jn = j + BLOCK_N
            blk_a = tl.load(bt_row + jn // PAGE_SIZE, mask=jn // PAGE_SIZE < bt_width, other=0)
            slot_n = (j % PAGE_SIZE)[:, None]
            k = tl.load(k_base + blk[:, None] * stride_kcb + slot_n * stride_kcs + offs_d[None, :],
                        mask=kv_ok[:, None], other=0.0)
            v = tl.load(v_base + blk[:, None] * stride_vcb + slot_n * stride_vcs + offs_d[None, :],
                        mask=kv_ok[:, None], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC)
            qk = tl.where(kv_ok[None, :], qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.math.exp2(qk - m_ij[:, None])
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
            m_i = m_ij
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        head = kvh * GROUP + offs_h
        tl.store(O + b64 * stride_ob + head[:, None] * stride_oh + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=h_ok[:, None])
        if PREFETCH:
            seq_len = n_len
            q = n_q
            blk_a = n_blk


def persistent_decode(q, kc, vc, bt, sl, scale, programs=None, prefetch=True, block_n=64, warps=4, stages=1):
    b, hq, d = q.shape
    _, page, hkv, _ = kc.shape
    items = b * hkv
    if programs is None:
        slots = 4 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        per = -(-items // slots)
        programs = -(-items // per)
    o = torch.empty_like(q)
    qs, ks, vs, os_ = q.stride(), kc.stride(), vc.stride(), o.stride()
    _persist_kernel[(programs,)](
        q, kc, vc, o, bt, sl, qs[0], qs[1], os_[0], os_[1], ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
        bt.stride(0), bt.shape[1], scale * LOG2E, items,
        HKV=hkv, GROUP=hq // hkv, BLOCK_H=max(16, next_pow2(hq // hkv)), HEAD_DIM=d, BLOCK_N=block_n,
        PAGE_SIZE=page, PREFETCH=prefetch, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages)
    return o


def check() -> None:
    """CPU (TRITON_INTERPRET=1): the persistent kernel against flash_decode_ref on ragged lengths."""
    torch.manual_seed(0)
    for b, hq, hkv, d, page, programs in [(3, 8, 2, 16, 16, 2), (5, 4, 4, 32, 16, 3), (2, 8, 1, 16, 4, 1)]:
        lens = torch.randint(1, 150, (b,), dtype=torch.int32)
        nb = int((lens.max() + page - 1) // page)
        pool = b * nb + 3
        kc = torch.randn(pool, page, hkv, d)
        vc = torch.randn_like(kc)
        bt = torch.randperm(pool)[: b * nb].to(torch.int32).view(b, nb)
        q = torch.randn(b, hq, d)
        ref = fd.flash_decode_ref(q, kc, vc, bt, lens, d ** -0.5)
        for pf in (False, True):
            out = persistent_decode(q, kc, vc, bt, lens, d ** -0.5, programs=programs, prefetch=pf, block_n=16)
            err = (out - ref).abs().max().item()
            print(f"b{b} hq{hq} hkv{hkv} d{d} page{page} P{programs} prefetch={pf}: max err {err:.2e}")
            assert err < 1e-4, err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["256x1024", "128x2048", "64x4096", "64x2048", "512x512"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    if a.check:
        check()
        return
    from triton.testing import do_bench_cudagraph

    from pageflash.bench.kernels import DECODE_HEADS, PAGE, engine_block_tables, pages_in_order

    hq, hkv, d = DECODE_HEADS
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def timed(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3

    sc = d ** -0.5
    summary = []
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        nb = L // PAGE
        pool = 2 * b * nb
        torch.manual_seed(0)
        kc = torch.randn(pool, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
        sl = torch.full((b,), L, device="cuda", dtype=torch.int32)
        shuf = torch.randperm(pool, device="cuda")[: b * nb].to(torch.int32).view(b, nb)
        tables = {"fresh": engine_block_tables(b, L, pool, churn=False), "shuf": shuf, "order": pages_in_order(shuf)}
        kk = kc[tables["fresh"].long()].flatten(1, 2).transpose(1, 2).contiguous()
        vv = vc[tables["fresh"].long()].flatten(1, 2).transpose(1, 2).contiguous()
        q4 = q.view(b, hq, 1, d)
        sp = fd.choose_num_splits(b, hkv, L, sms)
        ref = torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True).view(b, hq, d).float()
        fns = {"cudnn": lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)}
        variants = {
            "grid": lambda t: fd.flash_decode(q, kc, vc, t, sl, sc, num_splits=sp),
            "pers": lambda t: persistent_decode(q, kc, vc, t, sl, sc, prefetch=False),
            "pers+pf": lambda t: persistent_decode(q, kc, vc, t, sl, sc, prefetch=True),
            "pers+pf/5": lambda t: persistent_decode(q, kc, vc, t, sl, sc, prefetch=True,
                                                     programs=min(b * hkv, 5 * sms)),
        }
        errs = []
        for vname, f in variants.items():
            for tname, t in tables.items():
                errs.append((f(t).float() - ref).abs().max().item() if tname == "fresh" else 0.0)
                fns[f"{vname}/{tname}"] = (lambda f=f, t=t: f(t))
        print(f"{shape}: splits {sp}, items {b * hkv}, max |variant(fresh) - cuDNN| {max(errs):.3g}", flush=True)
        res = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, fn in fns.items():
                res[k].append(timed(fn))
        med = {k: statistics.median(v) for k, v in res.items()}
        for k, v in med.items():
            print(f"  {k:<18}{v:>8.1f} us  cudnn/this {med['cudnn'] / v:5.3f}  rounds "
                  + " ".join(f"{x:.1f}" for x in res[k]), flush=True)
        summary.append((shape, med))
        del kc, vc, kk, vv, fns, tables
        torch.cuda.empty_cache()
    print("\nshape        cudnn | grid / pers / pers+pf / pers+pf/5 per layout (cudnn/this)")
    for shape, m in summary:
        line = f"{shape:<12}{m['cudnn']:>6.1f}"
        for t in ("fresh", "shuf", "order"):
            line += f" | {t} " + " ".join(f"{m['cudnn'] / m[f'{v}/{t}']:.3f}"
                                         for v in ("grid", "pers", "pers+pf", "pers+pf/5"))
        print(line)


if __name__ == "__main__":
    main()
