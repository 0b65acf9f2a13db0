"""Probe: Flash-Decoding over the paged cache with Hopper TMA loads (device-side tensor descriptors)
against the package's pointer-load kernel and SDPA, on the W-attn-decode shapes.

The cache [num_blocks, page, Hkv, D] is seen as a 3-D tensor [num_blocks * page, Hkv, D]; one page
of one KV head is the box [page, 1, D] at (block * page, h, 0), fetched by the copy engine (TMA)
instead of by per-thread loads. PAGES 1: each loop iteration handles one page (one descriptor load
for K, one for V); PAGES 4: four pages, one box each, joined into a [64, D] tile (the pointer-load
kernel's BLOCK_N). A split's chunk is a multiple of PAGES pages. The partials go through the
package's combine kernel.
Not wired into the engine: this measures whether the route pays (docs/KERNELS.md, #3).

Usage: PYTHONPATH=. python scripts/tma_decode_probe.py            (GPU, sm_90)
       TRITON_INTERPRET=1 PYTHONPATH=. python scripts/tma_decode_probe.py --check   (CPU, small)
"""

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from pageflash.kernels.flash_decoding import (
    LOG2E, choose_num_splits, combine_partials, flash_decode, flash_decode_ref, split_range,
)


@triton.jit
def _join4(a, b, c, d):
    """[P, D] x 4 -> [4P, D], rows of a, then b, c, d."""
    z = tl.join(tl.join(a, b), tl.join(c, d))  # [P, D, 2 (a|b, c|d), 2 (ab|cd)]
    P: tl.constexpr = a.shape[0]
    D: tl.constexpr = a.shape[1]
    return tl.permute(z, (3, 2, 0, 1)).reshape(4 * P, D)


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _tma_split_kernel(Q, KC, VC, PO, PLSE, BT, SEQ_LENS, NROWS, stride_qb, stride_qh, stride_bt, qk_scale,
                      num_splits, HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                      D: tl.constexpr, PAGE: tl.constexpr, PAGES: tl.constexpr):
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    BLOCK_N: tl.constexpr = PAGE * PAGES
    kd = tl.make_tensor_descriptor(KC, shape=[NROWS, HKV, D], strides=[HKV * D, D, 1], block_shape=[PAGE, 1, D])
    vd = tl.make_tensor_descriptor(VC, shape=[NROWS, HKV, D], strides=[HKV * D, D, 1], block_shape=[PAGE, 1, D])
    seq_len = tl.load(SEQ_LENS + b)
    lo, hi = split_range(seq_len, split, num_splits, BLOCK_N, True)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    h_ok = offs_h < GROUP
    head = kvh * GROUP + offs_h
    q = tl.load(Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=h_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_bt
    offs_p = tl.arange(0, PAGE)
    if PAGES == 4:
        offs_p = tl.arange(0, 4 * PAGE)
    for start in range(lo, hi, PAGE * (4 if PAGES == 4 else 1)):
        if PAGES == 4:
            # four pages per iteration, one box each, joined into a [4 * PAGE, D] tile (rows in page
            # order); pages past the table's used part read block 0 and are masked below
            pg = start // PAGE
            b0 = tl.load(bt_row + pg)
            b1 = tl.load(bt_row + pg + 1, mask=start + PAGE < hi, other=0)
            b2 = tl.load(bt_row + pg + 2, mask=start + 2 * PAGE < hi, other=0)
            b3 = tl.load(bt_row + pg + 3, mask=start + 3 * PAGE < hi, other=0)
            k = _join4(kd.load([b0 * PAGE, kvh, 0]).reshape(PAGE, D), kd.load([b1 * PAGE, kvh, 0]).reshape(PAGE, D),
                       kd.load([b2 * PAGE, kvh, 0]).reshape(PAGE, D), kd.load([b3 * PAGE, kvh, 0]).reshape(PAGE, D))
            v = _join4(vd.load([b0 * PAGE, kvh, 0]).reshape(PAGE, D), vd.load([b1 * PAGE, kvh, 0]).reshape(PAGE, D),
                       vd.load([b2 * PAGE, kvh, 0]).reshape(PAGE, D), vd.load([b3 * PAGE, kvh, 0]).reshape(PAGE, D))
        else:
            blk = tl.load(bt_row + start // PAGE)
            k = kd.load([blk * PAGE, kvh, 0]).reshape(PAGE, D)
            v = vd.load([blk * PAGE, kvh, 0]).reshape(PAGE, D)
        j = start + offs_p
        qk = tl.dot(q, tl.trans(k))
        qk = tl.where((j < hi)[None, :], qk * qk_scale, float("-inf"))
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
    hq = GROUP * HKV
    row = (b.to(tl.int64) * hq + head) * num_splits + split
    tl.store(PO + row[:, None] * D + offs_d[None, :], out, mask=h_ok[:, None])
    tl.store(PLSE + row, lse, mask=h_ok)


def _alloc(size: int, alignment: int, stream):
    return torch.empty(size, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.int8)


def tma_decode(q, kc, vc, bt, seq_lens, scale, num_splits, pages=4, num_warps=4, num_stages=3):
    b, hq, d = q.shape
    nb, page, hkv, _ = kc.shape
    group = hq // hkv
    po = torch.empty(b, hq, num_splits, d, device=q.device, dtype=torch.float32)
    plse = torch.empty(b, hq, num_splits, device=q.device, dtype=torch.float32)
    _tma_split_kernel[(num_splits, hkv, b)](
        q, kc, vc, po, plse, bt, seq_lens, nb * page, q.stride(0), q.stride(1), bt.stride(0), scale * LOG2E,
        num_splits, HKV=hkv, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=d, PAGE=page,
        PAGES=pages, num_warps=num_warps, num_stages=num_stages)
    o = torch.empty_like(q)
    combine_partials(o, po, plse)
    return o


def _case(b, L, hq=32, hkv=8, d=128, page=16, dtype=torch.bfloat16, dev="cuda"):
    width = -(-L // page)
    nb = b * width + 3
    kc = torch.randn(nb, page, hkv, d, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb, device=dev)[: b * width].to(torch.int32).view(b, width)
    sl = torch.full((b,), L, device=dev, dtype=torch.int32)
    q = torch.randn(b, hq, d, device=dev, dtype=dtype)
    return q, kc, vc, bt, sl


def check():
    triton.set_allocator(_alloc)
    for b, L, hq, hkv in ((2, 77, 4, 2), (1, 300, 8, 2)):
        q, kc, vc, bt, sl = _case(b, L, hq, hkv, 16, 16, torch.float32, "cpu")
        ref = flash_decode_ref(q, kc, vc, bt, sl, 0.25)
        for pages in (1, 4):
            got = tma_decode(q, kc, vc, bt, sl, 0.25, num_splits=3, pages=pages)
            print(b, L, pages, "max |diff|", (got - ref).abs().max().item())
            assert torch.allclose(got, ref, atol=2e-3, rtol=2e-3)


def bench():
    import triton.testing as tt
    import torch.nn.functional as F

    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.empty(1 << 28, device="cuda", dtype=torch.uint8)
    copy_bw = 2 * x.numel() / (tt.do_bench(lambda: x.clone()) * 1e-3) / 1e9
    x = None
    print(f"copy {copy_bw:.0f} GB/s")
    rows = []
    for b, L in ((1, 32768), (8, 8192), (64, 2048), (1, 131072), (256, 1024)):
        q, kc, vc, bt, sl = _case(b, L)
        splits = choose_num_splits(b, 8, L, sms)
        nbytes = 2 * b * L * 8 * 128 * 2
        ref = flash_decode(q, kc, vc, bt, sl, 128**-0.5, num_splits=splits)
        res = {"ours": tt.do_bench_cudagraph(lambda: flash_decode(q, kc, vc, bt, sl, 128**-0.5, num_splits=splits))}
        for pages, warps, stages in ((4, 4, 3), (4, 4, 2), (4, 8, 3), (4, 4, 4)):
            for sp in sorted({splits, max(1, splits // 2)}):
                try:
                    got = tma_decode(q, kc, vc, bt, sl, 128**-0.5, sp, pages, warps, stages)
                    err = (got.float() - ref.float()).abs().max().item()
                    if err > 2e-2:
                        print(f"  B{b} L{L} p{pages} w{warps} s{stages} sp{sp}: wrong (max diff {err:.3g})")
                        continue
                    res[f"tma p{pages} w{warps} s{stages} sp{sp}"] = tt.do_bench_cudagraph(
                        lambda: tma_decode(q, kc, vc, bt, sl, 128**-0.5, sp, pages, warps, stages))
                except Exception as e:  # noqa: BLE001
                    print(f"  B{b} L{L} p{pages} w{warps} s{stages}: {type(e).__name__}: {str(e)[:200]}")
        kk = torch.randn(b, 8, L, 128, device="cuda", dtype=torch.bfloat16)
        vv = torch.randn_like(kk)
        q4 = q.view(b, 32, 1, 128)
        res["sdpa"] = tt.do_bench_cudagraph(lambda: F.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True))
        best = min((v, k) for k, v in res.items() if k.startswith("tma"))
        rows.append((b, L, res["ours"], best, res["sdpa"], nbytes))
        print(f"B{b} L{L}: " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in res.items()), flush=True)
        kc = vc = kk = vv = None  # free the tensors (the timed lambdas read these names)
        torch.cuda.empty_cache()
    print("\nB,L        ours us  %copy   best TMA us  %copy  (config)                 sdpa us")
    for b, L, ours, (t, k), sdpa, nbytes in rows:
        pct = lambda ms: 100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw  # noqa: E731
        print(f"{b},{L:<8d} {ours * 1e3:7.1f} {pct(ours):5.0f}%   {t * 1e3:9.1f} {pct(t):5.0f}%  ({k:22s}) {sdpa * 1e3:8.1f}")


if __name__ == "__main__":
    check() if "--check" in sys.argv else bench()
