"""Block ids loaded one tile ahead (BT_AHEAD=1) in the decode split kernel: does the deeper K/V
pipeline it allows stream closer to a plain read and to cuDNN?

With the block-table load inside the tile loop, Triton's pipeliner gives the K/V copies a single
shared-memory buffer whatever num_stages (39 KB at BLOCK_N 64, 3 stages: one tile in flight per
program, issued after the previous tile's math). With the block ids carried one iteration ahead,
the copies get num_stages - 1 buffers.
For each W-attn-decode shape: CUDA-graph replays (median) of each config x split count, the kernel
checked against the reference first (small shape), plus SDPA (cuDNN) in the same process.
Usage: python scripts/decode_ahead_probe.py [--shapes 1x32768 ...] [--quick]
"""

import argparse

import torch
from triton.testing import do_bench_cudagraph

import pageflash.kernels.flash_decoding as fd
from pageflash.bench.kernels import DECODE_HEADS, PAGE, decode_case, decode_config_mismatches

HQ, HKV, D = DECODE_HEADS
CONFIGS = [  # BT_AHEAD, STRIDED, BLOCK_N, warps, stages
    (0, 0, 64, 4, 3), (1, 0, 64, 4, 3), (1, 0, 64, 4, 2), (1, 1, 64, 4, 3), (1, 1, 64, 4, 2), (1, 1, 32, 4, 4),
    (1, 1, 32, 4, 3),
]
SEQ_CONFIGS = [(0, 0, 64, 4, 3), (1, 0, 64, 4, 3), (1, 1, 64, 4, 3), (1, 1, 64, 4, 2)]  # also timed over sequential pages


def cfg_of(c):
    a, st, bn, w, s = c
    return dict(BT_AHEAD=a, STRIDED=bool(st), BLOCK_N=bn, num_warps=w, num_stages=s)


def name_of(c, sp):
    a, st, bn, w, s = c
    return f"a{a}{'S' if st else 'C'} n{bn} w{w} s{s} sp{sp}"


def setup(b, L, seed=0):
    return decode_case(b, L, seed)


def check():
    bad = decode_config_mismatches([cfg_of(c) for c in CONFIGS])
    print("check:", "all configs match the reference" if not bad else f"MISMATCH {bad}", flush=True)
    return not bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1x32768", "8x8192", "64x2048", "1x131072", "256x1024"])
    a = ap.parse_args()
    ok = check()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = []
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        q, kc, vc, bt, sl = setup(b, L)
        nbytes = 2 * b * L * HKV * D * 2
        base = fd.choose_num_splits(b, HKV, L, sms)
        res = {}
        seq_bt = torch.arange(b * (L // PAGE), device="cuda", dtype=torch.int32).view(b, -1)
        for c in CONFIGS + [("seq",) + c for c in SEQ_CONFIGS]:
            table_ = seq_bt if c[0] == "seq" else bt
            c_ = c[1:] if c[0] == "seq" else c
            cfg = cfg_of(c_)
            for sp in sorted({base, max(1, base // 2)} if base > 1 else {1}):
                fn = lambda: fd.flash_decode(q, kc, vc, table_, sl, D ** -0.5, num_splits=sp, config=cfg)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                key = ("seqpages " if c[0] == "seq" else "") + name_of(c_, sp)
                res[key] = do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
        kk = kc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
        vv = vc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
        q4 = q.view(b, HQ, 1, D)
        f = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)  # noqa: E731
        f()
        torch.cuda.synchronize()
        cud = do_bench_cudagraph(f, rep=200, return_mode="median") * 1e3
        best = sorted(res.items(), key=lambda kv: kv[1])
        print(f"{shape}: cudnn {cud:.1f} us; base {res[name_of(CONFIGS[0], base)]:.1f}; best "
              + ", ".join(f"{k} {v:.1f}" for k, v in best[:5]), flush=True)
        table.append((shape, nbytes, cud, res, base))
        del kk, vv, kc, vc
        torch.cuda.empty_cache()
    allkeys = sorted({k for t in table for k in t[3]})
    print(f"{'config':<34}" + "".join(f"{t[0]:>10}" for t in table))
    print(f"{'cudnn':<34}" + "".join(f"{t[2]:>10.1f}" for t in table))
    for k in allkeys:
        print(f"{k:<34}" + "".join(f"{t[3].get(k, float('nan')):>10.1f}" for t in table))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
