"""How much of decode's ~1% against cuDNN is where the buffers land in DRAM?

Run 24 timed the same kernel over the same in-order block table (B256 L1k) at 357.8 us in one probe and
351.4 us in another, in the same session: only the other tensors allocated before the cache differed,
i.e. the cache's physical placement. Here each round allocates a pad of a different size first, then
the paged cache (block tables as the engine's allocator hands them out, fresh and churned, and in
order) and SDPA's contiguous K/V, and times cuDNN and our kernel over each, as CUDA-graph replays.
Each placement is a fresh allocation of both sides, so both are subject to the same luck.

Prints per placement the times and cuDNN/ours, then the median and range of each ratio.
Usage: python scripts/decode_placement_probe.py [--shapes 64x2048 256x1024] [--placements 8]
       [--locality 64 256 1024]   (the allocator's run, in tokens, compared)
"""

import argparse
import statistics

import torch
from triton.testing import do_bench_cudagraph

import pageflash.kernels.flash_decoding as fd
from pageflash.bench.kernels import DECODE_HEADS, PAGE, engine_block_tables, pages_in_order

HQ, HKV, D = DECODE_HEADS


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["64x2048", "256x1024"])
    ap.add_argument("--placements", type=int, default=8)
    ap.add_argument("--locality", type=int, nargs="*", default=[64],
                    help="KVCacheManager locality_tokens values to compare (engine layouts named @value)")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sc = D ** -0.5
    final = []
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        nb = L // PAGE
        pool = 2 * b * nb
        tables = {}
        for loc in a.locality:
            sfx = "" if len(a.locality) == 1 else f"@{loc}"
            tables["fresh" + sfx] = engine_block_tables(b, L, pool, churn=False, locality_tokens=loc)
            tables["churned" + sfx] = engine_block_tables(b, L, pool, churn=True, locality_tokens=loc)
        tables["order"] = pages_in_order(next(iter(tables.values())))
        sp = fd.choose_num_splits(b, HKV, L, sms)
        ratios = {k: [] for k in tables}
        for i in range(a.placements):
            torch.manual_seed(i)
            # pads of 0 .. ~1.1 GB in odd steps of 2 MB + 64 KB: the cache and SDPA's buffers land elsewhere
            pad = torch.empty(i * ((139 << 20) + (64 << 10)), dtype=torch.uint8, device="cuda")
            kc = torch.randn(pool, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
            sl = torch.full((b,), L, device="cuda", dtype=torch.int32)
            first = next(iter(tables.values()))
            kk = kc[first.long()].flatten(1, 2).transpose(1, 2).contiguous()
            vv = vc[first.long()].flatten(1, 2).transpose(1, 2).contiguous()
            q4 = q.view(b, HQ, 1, D)
            t = {"cudnn": timed(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True))}
            for name, bt in tables.items():
                t[name] = timed(lambda bt=bt: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=sp))
            t["cudnn2"] = timed(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True))
            cud = (t["cudnn"] + t["cudnn2"]) / 2
            for name in tables:
                ratios[name].append(cud / t[name])
            print(f"{shape} placement {i}: cudnn {t['cudnn']:.1f}/{t['cudnn2']:.1f} us, "
                  + ", ".join(f"{n} {t[n]:.1f} ({cud / t[n]:.3f})" for n in tables), flush=True)
            del pad, kc, vc, kk, vv, q
            torch.cuda.empty_cache()
        final.append((shape, ratios))
    print("\ncuDNN / ours over placements: median [min, max], count of placements >= 1.000")
    for shape, ratios in final:
        for name, r in ratios.items():
            print(f"  {shape:<10}{name:<14}{statistics.median(r):.3f} [{min(r):.3f}, {max(r):.3f}]  "
                  f"{sum(x >= 1.0 for x in r)}/{len(r)}")


if __name__ == "__main__":
    main()
