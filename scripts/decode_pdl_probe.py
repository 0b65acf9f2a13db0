"""Does launching the decode combine as a programmatic dependent launch (PDL) close the B1 L32k gap?

For split W-attn-decode shapes (and a few shorter ones), CUDA-graph replays (do_bench_cudagraph,
median of alternated rounds) of flash_decode with config overrides:
  base        the default (split kernel, then the combine kernel)
  pdl1        combine launched with launch_pdl; the split kernel signals dependents at its start, so
              the combine's programs sit resident in gdc_wait until the split grid ends
  pdl2        the same, signalling after the key loop
  pdl1-dc16 / pdl1-dc64 / pdl1-w1 / pdl1-w4   the combine's columns per program / warps, with pdl1
  s64 / s64-pdl1   64 splits instead of choose_num_splits' (B1 only: 8 tiles a split at L32k)
  cudnn       SDPA on contiguous KV (its pick), enable_gqa
Outputs of every variant are checked bitwise against base (same arithmetic) and base against the
reference. Usage: PYTHONPATH=.:scripts python scripts/decode_pdl_probe.py [--rounds 3] [--shapes 1x32768 ...]
--eager: instead, eager calls of base and pdl1: do_bench with the L2 flushed between calls (as `bench
kernels` times them) and the host's time per call (a burst of 200 calls, one sync at the end).
"""

import argparse
import statistics
import time

import torch
from triton.testing import do_bench

import pageflash.kernels.flash_decoding as fd
from pageflash.bench.kernels import DECODE_HEADS, contiguous_kv, copy_bandwidth, decode_case
from probe_timing import graph_rounds

HQ, HKV, D = DECODE_HEADS
VARIANTS = {
    "base": {},
    "pdl1": {"PDL": 1},
    "pdl2": {"PDL": 2},
    "pdl1-dc16": {"PDL": 1, "COMBINE_BLOCK_DC": 16},
    "pdl1-dc64": {"PDL": 1, "COMBINE_BLOCK_DC": 64},
    "pdl1-w1": {"PDL": 1, "COMBINE_num_warps": 1},
    "pdl1-w4": {"PDL": 1, "COMBINE_num_warps": 4},
}


def fns(b, L):
    q, kc, vc, bt, sl = decode_case(b, L)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = fd.choose_num_splits(b, HKV, L, sms)
    sc = D ** -0.5
    out = {}
    for name, cfg in VARIANTS.items():
        out[name] = (lambda cfg=cfg: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=splits, config=cfg))
    if b == 1 and splits != 64:
        out["s64"] = lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=64)
        out["s64-pdl1"] = lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=64, config={"PDL": 1})
    kk, vv = contiguous_kv(kc, vc, bt)
    q4 = q.view(b, HQ, 1, D)
    out["cudnn"] = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)
    ref = fd.flash_decode_ref(q, kc, vc, bt, sl, sc) if b * L <= 32768 else None
    return out, splits, 2 * b * L * HKV * D * 2, ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1x32768", "8x8192", "1x131072", "1x4096", "16x2048"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--eager", action="store_true")
    a = ap.parse_args()
    if a.eager:
        return eager(a)
    bw = copy_bandwidth()
    print(f"copy {bw:.0f} GB/s", flush=True)
    rows = []
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        f, splits, nbytes, ref = fns(b, L)
        base = f["base"]().clone()
        if ref is not None:
            err = (base.float() - ref.float()).abs().max().item()
            assert err < 2e-2, ("base vs ref", err)
        for name, fn in f.items():
            if name in VARIANTS:
                o = fn()
                torch.cuda.synchronize()
                # PDL alone changes no arithmetic; other warps / columns a program may reorder the sums
                ok = torch.equal(o, base) if name in ("pdl1", "pdl2") else \
                    (o.float() - base.float()).abs().max().item() < 1e-3
                assert ok, (shape, name, (o.float() - base.float()).abs().max().item())
        t = graph_rounds(f, a.rounds)
        med = {n: statistics.median(v) for n, v in t.items()}
        rows.append((shape, splits, nbytes, med))
        print(shape, splits, {k: [round(x, 2) for x in v] for k, v in t.items()}, flush=True)
        del f
        torch.cuda.empty_cache()
    names = list(VARIANTS) + ["s64", "s64-pdl1", "cudnn"]
    print(f"{'shape':<10}{'sp':>4}" + "".join(f"{n:>10}" for n in names) + f"{'%copy base':>11}{'pdl1':>6}{'best':>6}")
    for shape, splits, nbytes, t in rows:
        print(f"{shape:<10}{splits:>4}" + "".join(f"{t.get(n, float('nan')):>10.2f}" for n in names)
              + f"{100 * nbytes / t['base'] / 1e3 / bw:>10.1f}%{100 * nbytes / t['pdl1'] / 1e3 / bw:>5.1f}%"
              + f"{100 * nbytes / min(v for k, v in t.items() if k != 'cudnn') / 1e3 / bw:>5.1f}%")


def eager(a):
    print(f"{'shape':<10}{'variant':>8}{'do_bench us':>13}{'host us/call':>14}")
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        f = fns(b, L)[0]
        for _ in range(a.rounds):
            for name in ("base", "pdl1"):
                fn = f[name]
                fn()
                torch.cuda.synchronize()
                ms = do_bench(fn, rep=100, return_mode="median")
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                host = (time.perf_counter() - t0) / 200 * 1e6
                torch.cuda.synchronize()
                print(f"{shape:<10}{name:>8}{ms * 1e3:>13.1f}{host:>14.1f}", flush=True)
        del f
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
