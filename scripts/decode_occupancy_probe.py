"""Decode split-kernel variants over three layouts of the same K/V, against cuDNN SDPA in the same process.

Layouts: the paged cache with its pages shuffled over the pool (`shuf`, the bench's headline), the
same cache with each sequence's pages in order (`order`), and SDPA's own contiguous [B, Hkv, L, D]
buffers seen as a paged cache (`sdpa's`: blocks of PAGE rows, block stride PAGE * D, head stride
L * D, each sequence's blocks listed in order), i.e. the very bytes cuDNN reads, where they lie.
Variants: the default config and occupancy against stages (2 warps, one stage: no shared-memory double
buffer, so more programs per SM; BLOCK_N 32 / 128; split counts aimed at 3-8 programs per SM).
(An L2 prefetch of the tile 1-3 iterations ahead and a per-sequence rotated tile order were timed with
this script at commit c91d6b3, register caps (ptxas maxnreg 64 / 96) at 68f278e, one L2 prefetch per
page 1-8 tiles ahead (address translations early, variants tlb1..tlb8) at 4270142; docs/KERNELS.md.)

Per W-attn-decode shape: CUDA-graph replays (median over alternated rounds). Each variant is checked
against the reference first, and the outputs over the paged cache and over SDPA's buffers compared.
Usage: python scripts/decode_occupancy_probe.py [--shapes 1x32768 ...] [--rounds 3] [--variants ...]
"""

import argparse
import statistics

import torch
from triton.testing import do_bench_cudagraph

import pageflash.bench.kernels as bk
import pageflash.kernels.flash_decoding as fd
from pageflash.bench.kernels import (DECODE_CHECK_CASES, DECODE_HEADS, decode_case, decode_config_mismatches,
                                     pages_in_order)

HQ, HKV, D = DECODE_HEADS
VARIANTS = {  # name: (override of decode_config's choice, programs per SM that the split count aims at)
    "default": ({}, 4),
    # occupancy instead of stages: fewer warps or no shared-memory double buffer, more programs per SM
    "s2": (dict(num_stages=2), 4),
    "s1": (dict(num_stages=1), 4),
    "w2": (dict(num_warps=2), 4),
    "w2 x6": (dict(num_warps=2), 6),
    "s1 x8": (dict(num_stages=1), 8),
    "s1 w2 x8": (dict(num_stages=1, num_warps=2), 8),
    "s1 n32 w2 x8": (dict(num_stages=1, num_warps=2, BLOCK_N=32), 8),
    "n128 x3": (dict(BLOCK_N=128), 3),
    "n32 w2 s3 x6": (dict(BLOCK_N=32, num_warps=2, num_stages=3), 6),
    # for small heads (smollm2-135m: 9 / 3 heads, D 64), where a tile holds half the bytes ("n64": the
    # D 64 config before 128-key split tiles; "s2": the D 128 config before one stage)
    "n64": (dict(BLOCK_N=64), 4),
    "s2 x6": (dict(num_stages=2), 6),
    "s2 x8": (dict(num_stages=2), 8),
    "s3": (dict(num_stages=3), 4),
    "s3 x6": (dict(num_stages=3), 6),
    "n128 s2": (dict(BLOCK_N=128, num_stages=2), 4),
    "n128 s2 x6": (dict(BLOCK_N=128, num_stages=2), 6),
    "n128 s1 x6": (dict(BLOCK_N=128, num_stages=1), 6),
    "n128 s3": (dict(BLOCK_N=128, num_stages=3), 4),
    "w2 s2 x8": (dict(num_warps=2, num_stages=2), 8),
    # H200 (run 58): more bytes in flight per SM than one stage gives
    "s2 x3": (dict(num_stages=2), 3),
    "s2 x5": (dict(num_stages=2), 5),  # 2 stages fit 5 programs an SM (96-101 registers, 39 KB)
    "n32 s3": (dict(BLOCK_N=32, num_stages=3), 4),
    "n32 s4 x3": (dict(BLOCK_N=32, num_stages=4), 3),
    "n32 s2 x5": (dict(BLOCK_N=32, num_stages=2), 5),
    "n32 s3 x5": (dict(BLOCK_N=32, num_stages=3), 5),
    "s2 w8": (dict(num_stages=2, num_warps=8), 4),
    "s2 w2 x6": (dict(num_stages=2, num_warps=2), 6),
    # a third field: splits for the shapes the default leaves unsplit (B64 / B256: wave balance)
    "s2 sp2": (dict(num_stages=2), 4, 2),
    "s2 x3 sp2": (dict(num_stages=2), 3, 2),
}


def timed(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def compiled_variants():
    """(cp.async count in the PTX, shared memory bytes, registers, spills) per compiled split-kernel variant."""
    out = {}
    for key, (ck, _tail) in fd._decode_split_kernel._cache.items():
        kw = dict(key[1])
        name = f"n{kw.get('BLOCK_N')} w{kw.get('num_warps')} s{kw.get('num_stages')} split{kw.get('SPLIT')}"
        out[name] = (ck.asm.get("ptx", "").count("cp.async.cg"), ck.metadata.shared, ck.n_regs, ck.n_spills)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1x32768", "8x8192", "64x2048", "1x131072", "256x1024"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", nargs=3, type=int, metavar=("HQ", "HKV", "D"),
                    help="other heads than W-attn-decode's (e.g. 9 3 64: smollm2-135m)")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    a = ap.parse_args()
    global HQ, HKV, D
    if a.heads:
        HQ, HKV, D = a.heads
        bk.DECODE_HEADS = tuple(a.heads)  # decode_case and the reference check read it
    cfgs = [VARIANTS[v][0] for v in a.variants]  # overrides of flash_decode's config for each launch
    bad = decode_config_mismatches(cfgs, DECODE_CHECK_CASES + [(1, 20000, 66)])
    print("check:", "all variants match the reference" if not bad else f"MISMATCH {bad}", flush=True)
    if bad:
        raise SystemExit(1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sc = D ** -0.5
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        q, kc, vc, bt, sl = decode_case(b, L)
        bt_seq = pages_in_order(bt)
        kk = kc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
        vv = vc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
        q4 = q.view(b, HQ, 1, D)
        kc_c, vc_c, bt_c = bk.contiguous_as_cache(kk, vv)  # "sdpa's": the bytes cuDNN reads, in place
        base_sp = fd.choose_num_splits(b, HKV, L, sms)
        fns = {"cudnn": lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)}
        for v in a.variants:
            over, slots, *unsplit = VARIANTS[v]
            cfg = over
            sp = fd.choose_num_splits(b, HKV, L, sms, slots_per_sm=slots) if base_sp > 1 else (unsplit or [1])[0]
            for order, table_, kc_, vc_ in (("shuf", bt, kc, vc), ("order", bt_seq, kc, vc),
                                            ("sdpa's", bt_c, kc_c, vc_c)):
                fns[f"{v} sp{sp} {order}"] = (lambda cfg=cfg, sp=sp, t=table_, k_=kc_, v_=vc_:
                                              fd.flash_decode(q, k_, v_, t, sl, sc, num_splits=sp, config=cfg))
        same = (fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=base_sp).float()
                - fd.flash_decode(q, kc_c, vc_c, bt_c, sl, sc, num_splits=base_sp).float()).abs().max().item()
        print(f"{shape}: max |ours over the paged cache - ours over sdpa's buffers| = {same}", flush=True)
        res = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, fn in fns.items():
                try:
                    res[k].append(timed(fn))
                except Exception as e:  # e.g. out of shared memory
                    print(shape, k, "failed:", type(e).__name__, str(e)[:120], flush=True)
                    res[k].append(float("nan"))
        med = {k: statistics.median(v) for k, v in res.items()}
        nbytes = 2 * b * L * HKV * D * 2
        print(f"\n== {shape} default splits {base_sp} ({nbytes / 1e6:.0f} MB K+V)", flush=True)
        for k, v in med.items():
            print(f"  {k:<28}{v:>8.1f} us {nbytes / v / 1e3:>6.0f} GB/s  cudnn/this {med['cudnn'] / v:5.3f}  "
                  f"rounds {' '.join(f'{x:.1f}' for x in res[k])}", flush=True)
        del q, kc, vc, bt, bt_seq, kk, vv, kc_c, vc_c, bt_c, fns
        torch.cuda.empty_cache()
    print("\ncompiled variants: (cp.async in the PTX, shared bytes, registers, spills)")
    for k, v in sorted(compiled_variants().items()):
        print(f"  {k:<28}{v}")


if __name__ == "__main__":
    main()
