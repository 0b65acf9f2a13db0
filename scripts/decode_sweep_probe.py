"""Decode split-kernel configs and combine variants, with the block ids ahead and strided splits, against
cuDNN SDPA in the same process (CUDA-graph replays, median).

Per W-attn-decode shape:
  - split configs (BLOCK_N, warps, stages) x split counts, with the default combine;
  - combine variants (column chunks per program, eager partial loads, warps) with the default split config;
  - the split kernel alone (combine skipped) for the default config: what the combine adds;
  - SDPA (cuDNN) over a contiguous copy of the same K/V.
Every config is checked against the reference on small shapes first.
Usage: python scripts/decode_sweep_probe.py [--shapes 1x32768 ...] [--quick]
"""

import argparse

import torch
from triton.testing import do_bench_cudagraph

import pageflash.kernels.flash_decoding as fd
from pageflash.bench.kernels import (DECODE_CHECK_CASES, DECODE_HEADS, decode_case, decode_config_mismatches,
                                     pages_in_order)

HQ, HKV, D = DECODE_HEADS
SPLIT_CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3), (32, 4, 3)]
COMBINES = [
    dict(),
    dict(COMBINE_EAGER=True),
    dict(COMBINE_BLOCK_DC=32),
    dict(COMBINE_BLOCK_DC=32, COMBINE_EAGER=True),
    dict(COMBINE_BLOCK_DC=64, COMBINE_EAGER=True),
    dict(COMBINE_BLOCK_DC=32, COMBINE_EAGER=True, COMBINE_num_warps=2),
    dict(COMBINE_BLOCK_DC=16, COMBINE_EAGER=True, COMBINE_num_warps=1),
]


def cfg_of(c, comb=None):
    bn, w, s = c
    cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=s, BT_AHEAD=1, STRIDED=True)
    cfg.update(comb or {})
    return cfg


def cname(comb):
    if not comb:
        return "combine default"
    return "combine " + " ".join(f"{k[8:]}={v}" for k, v in comb.items())


def check():
    cfgs = [cfg_of(c, comb) for c in SPLIT_CONFIGS for comb in (COMBINES if c == SPLIT_CONFIGS[0] else [dict()])]
    bad = decode_config_mismatches(cfgs, DECODE_CHECK_CASES + [(1, 20000, 66)])
    print("check:", "all configs match the reference" if not bad else f"MISMATCH {bad}", flush=True)
    return not bad


def timed(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1x32768", "8x8192", "64x2048", "1x131072", "256x1024"])
    ap.add_argument("--quick", action="store_true", help="default config and combines only")
    a = ap.parse_args()
    if not check():
        raise SystemExit(1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sc = D ** -0.5
    summary = []
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        q, kc, vc, bt, sl = decode_case(b, L)
        bt_seq = pages_in_order(bt)
        nbytes = 2 * b * L * HKV * D * 2
        base_sp = fd.choose_num_splits(b, HKV, L, sms)
        if base_sp > 1:
            sps = sorted({base_sp} | {fd.choose_num_splits(b, HKV, L, sms, slots_per_sm=k) for k in (2, 3, 6)}
                         | {max(1, base_sp // 64 * 64)} - {0})
        else:
            sps = [1, 2]
        torch.cuda.synchronize()
        res = {}
        kk = kc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
        vv = vc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
        q4 = q.view(b, HQ, 1, D)
        res["cudnn"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True))
        del kk, vv
        configs = SPLIT_CONFIGS[:1] if a.quick else SPLIT_CONFIGS
        for c in configs:
            for sp in sps:
                cfg = cfg_of(c)
                try:
                    res[f"n{c[0]} w{c[1]} s{c[2]} sp{sp}"] = timed(
                        lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=sp, config=cfg))
                except Exception as e:  # e.g. out of shared memory
                    print(shape, c, sp, "failed:", type(e).__name__, str(e)[:100], flush=True)
        if base_sp > 1:
            for comb in COMBINES:
                cfg = cfg_of(SPLIT_CONFIGS[0], comb)
                res[f"{cname(comb)} sp{base_sp}"] = timed(
                    lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=base_sp, config=cfg))
            real = fd.combine_partials
            fd.combine_partials = lambda *a_, **k_: None
            try:
                res[f"split kernel alone sp{base_sp}"] = timed(
                    lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=base_sp))
            finally:
                fd.combine_partials = real
        # the three best split rows and the best combine again, over pages in order
        best = sorted((k for k in res if k.startswith("n")), key=res.get)[:3]
        for k in best:
            f = k.split()
            bn, w, s, sp = int(f[0][1:]), int(f[1][1:]), int(f[2][1:]), int(f[3][2:])
            cfg = cfg_of((bn, w, s))
            res[f"in order {k}"] = timed(lambda: fd.flash_decode(q, kc, vc, bt_seq, sl, sc, num_splits=sp, config=cfg))
        print(f"\n== {shape}  default splits {base_sp}  ({nbytes / 1e6:.0f} MB K+V)", flush=True)
        for k, v in sorted(res.items(), key=lambda kv: kv[1]):
            print(f"  {k:<58}{v:>8.1f} us  {nbytes / v / 1e3:>6.0f} GB/s  cudnn/this {res['cudnn'] / v:5.3f}",
                  flush=True)
        default_key = f"n64 w4 s2 sp{base_sp}"
        summary.append((shape, res["cudnn"], res.get(default_key), min((v, k) for k, v in res.items()
                                                                        if k != "cudnn" and not k.startswith("in order")
                                                                        and not k.startswith("split kernel"))))
        del q, kc, vc, bt, bt_seq
        torch.cuda.empty_cache()
    print("\nshape      cudnn   default   best (shuffled pages)")
    for shape, cud, dflt, (bv, bk) in summary:
        print(f"{shape:<10}{cud:>7.1f}{dflt or float('nan'):>9.1f}{bv:>8.1f}  {bk}")


if __name__ == "__main__":
    main()
