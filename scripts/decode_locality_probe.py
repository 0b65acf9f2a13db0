"""Why do shuffled pages cost the decode kernel 1-4%? Page order and K/V placement, against cuDNN SDPA.

Per W-attn-decode shape, CUDA-graph replays (median) of flash_decode (default config) over the same
K/V with:
  - the pages of each cache shuffled over the whole pool (the bench's headline), in order, or shuffled
    only within groups of pages that share one 2 MB region (TLB-friendly, DRAM-row-unfriendly);
  - K and V as two tensors [blocks, page, Hkv, D] (the engine's caches), or interleaved in one
    [blocks, 2, page, Hkv, D] tensor seen through two strided views (a block's K and V adjacent: a
    tile touches half as many distant places).
Prediction: if translation (TLB reach) is what shuffling costs, "local" ~ "in order" and interleaving
helps; if DRAM row locality is, "local" ~ "shuffled".
Also: eager timings (triton do_bench, L2 flushed) and a torch.profiler timeline of eager calls at
B1 L32k, ours against SDPA: kernel durations and the idle gaps before them.
Usage: python scripts/decode_locality_probe.py [--shapes 1x32768 ...] [--no-profile]
"""

import argparse

import torch
from triton.testing import do_bench, do_bench_cudagraph

import pageflash.kernels.flash_decoding as fd
from pageflash.bench.kernels import DECODE_HEADS, PAGE

HQ, HKV, D = DECODE_HEADS
REGION = 2 << 20


def block_order(n, kind, block_bytes):
    if kind == "in order":
        return torch.arange(n)
    if kind == "shuffled":
        return torch.randperm(n)
    per = max(1, REGION // block_bytes)  # blocks per 2 MB region, shuffled within it
    idx = torch.arange(n)
    out = []
    for i in range(0, n, per):
        g = idx[i:i + per]
        out.append(g[torch.randperm(len(g))])
    return torch.cat(out)


def make(b, L, interleaved, kind, seed=0):
    torch.manual_seed(seed)
    nb = (L + PAGE - 1) // PAGE
    n = b * nb + 1
    if interleaved:
        kv = torch.randn(n, 2, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
        kc, vc = kv[:, 0], kv[:, 1]
    else:
        kc = torch.randn(n, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
    block_bytes = PAGE * HKV * D * 2 * (2 if interleaved else 1)
    bt = block_order(n, kind, block_bytes)[: b * nb].to(torch.int32).view(b, nb).cuda()
    sl = torch.full((b,), L, device="cuda", dtype=torch.int32)
    q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
    return q, kc, vc, bt, sl


def timed(fn, graph=True):
    fn()
    torch.cuda.synchronize()
    if graph:
        return do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def profile_eager(b, L):
    from torch.profiler import ProfilerActivity, profile

    q, kc, vc, bt, sl = make(b, L, False, "shuffled")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sp = fd.choose_num_splits(b, HKV, L, sms)
    kk = kc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
    vv = vc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
    q4 = q.view(b, HQ, 1, D)
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fns = {
        "ours": lambda: fd.flash_decode(q, kc, vc, bt, sl, D ** -0.5, num_splits=sp),
        "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True),
    }
    for name, fn in fns.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                flush.zero_()
                fn()
            torch.cuda.synchronize()
        evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
        # per iteration: the flush, then the function's kernels; gaps between consecutive kernels
        rows = {}
        prev_end = None
        for e in evs:
            start, end = e.time_range.start, e.time_range.end
            gap = (start - prev_end) if prev_end is not None else 0
            prev_end = end
            k = e.name[:60]
            r = rows.setdefault(k, [0, 0.0, 0.0])
            r[0] += 1
            r[1] += end - start
            r[2] += gap
        print(f"  eager timeline {name} B{b} L{L}: kernel, count, mean us, mean idle gap before it (us)")
        for k, (c, dur, gap) in rows.items():
            print(f"    {k:<62}{c:>4}{dur / c:>9.1f}{gap / c:>9.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1x32768", "8x8192", "64x2048", "1x131072", "256x1024"])
    ap.add_argument("--no-profile", action="store_true")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    comb = dict(COMBINE_BLOCK_DC=64, COMBINE_EAGER=True)
    # correctness of the interleaved views first (small)
    q, kc, vc, bt, sl = make(3, 1000, True, "shuffled", seed=1)
    sl = torch.tensor([1000, 17, 640], device="cuda", dtype=torch.int32)
    ref = fd.flash_decode_ref(q, kc, vc, bt, sl, D ** -0.5).float()
    err = (fd.flash_decode(q, kc, vc, bt, sl, D ** -0.5, num_splits=5).float() - ref).abs().max().item()
    print("interleaved K/V views vs reference: max err", err, flush=True)
    assert err < 2e-2
    table = []
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        sp = fd.choose_num_splits(b, HKV, L, sms)
        res = {}
        for inter in (False, True):
            for kind in ("shuffled", "local", "in order"):
                q, kc, vc, bt, sl = make(b, L, inter, kind)
                name = f"{'interleaved' if inter else 'separate'} {kind}"
                res[name] = timed(lambda: fd.flash_decode(q, kc, vc, bt, sl, D ** -0.5, num_splits=sp))
                if sp > 1 and not inter:
                    res[name + " +combine DC64 eager"] = timed(
                        lambda: fd.flash_decode(q, kc, vc, bt, sl, D ** -0.5, num_splits=sp, config=comb))
                if kind == "shuffled" and not inter:
                    res["eager separate shuffled"] = timed(
                        lambda: fd.flash_decode(q, kc, vc, bt, sl, D ** -0.5, num_splits=sp), graph=False)
                    kk = kc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
                    vv = vc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
                    q4 = q.view(b, HQ, 1, D)
                    sd = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)  # noqa
                    res["cudnn"] = timed(sd)
                    res["eager cudnn"] = timed(sd, graph=False)
                    del kk, vv
                del q, kc, vc, bt
                torch.cuda.empty_cache()
        print(f"\n== {shape} splits {sp}", flush=True)
        for k, v in res.items():
            print(f"  {k:<44}{v:>8.1f} us   cudnn/this {res['cudnn'] / v:5.3f}", flush=True)
        table.append((shape, res))
    keys = ["cudnn", "separate shuffled", "separate local", "separate in order", "interleaved shuffled",
            "interleaved local", "interleaved in order", "eager cudnn", "eager separate shuffled"]
    print("\nshape     " + "".join(f"{k.replace('separate', 'sep').replace('interleaved', 'int'):>14}" for k in keys))
    for shape, res in table:
        print(f"{shape:<10}" + "".join(f"{res.get(k, float('nan')):>14.1f}" for k in keys))
    if not a.no_profile:
        try:
            profile_eager(1, 32768)
        except Exception as e:  # the profiler's event API varies across torch versions
            print("profile failed:", type(e).__name__, e)


if __name__ == "__main__":
    main()
