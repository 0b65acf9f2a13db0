"""Decode over the block tables the engine's own allocator hands out, against the bench's layouts and cuDNN.

The bench times the split kernel over pages shuffled over the whole pool (worst case) and in order
(a fresh pool's long prompts). This probe asks what the engine's KVCacheManager actually produces
(`bench.kernels.engine_block_tables`, which the bench now also times): each W-attn-decode shape's B
sequences get prompts of L - G tokens (blocks allocated at once, as a prefill does) and then grow one
token per step together for G tokens (decode-time blocks of concurrent sequences interleave), in a
pool twice their size:
- `fresh`:  a fresh pool;
- `churned`: after 3 x B requests of random prompt (100-1024) and output (1-512) lengths went through
  the same pool with continuous batching (B at a time), so the free queue is in freeing order.
Both against `shuf` (the bench's whole-pool shuffle), `order` (each sequence's pages ascending) and
cuDNN SDPA on the contiguous copy, CUDA-graph replays, medians over alternated rounds. It also prints
how many distinct 2 MB regions of the K pool a sequence's blocks touch (what run 21 found to cost).

Usage: python scripts/decode_engine_layout_probe.py [--shapes 1x32768 ...] [--rounds 3]
"""

import argparse
import statistics

import torch
from triton.testing import do_bench_cudagraph

import pageflash.kernels.flash_decoding as fd
from pageflash.bench.kernels import DECODE_HEADS, PAGE, engine_block_tables, pages_in_order

HQ, HKV, D = DECODE_HEADS


def regions(bt: torch.Tensor) -> float:
    """Mean number of distinct 2 MB regions of the K pool that one sequence's blocks lie in."""
    per_region = (2 << 20) // (PAGE * HKV * D * 2)
    return sum(len(set((row // per_region).tolist())) for row in bt.cpu()) / bt.shape[0]


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=60, return_mode="median") * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1x32768", "8x8192", "64x2048", "1x131072", "256x1024"])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sc = D ** -0.5
    summary = []
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        nb = L // PAGE
        pool = 2 * b * nb
        torch.manual_seed(0)
        kc = torch.randn(pool, PAGE, HKV, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        q = torch.randn(b, HQ, D, device="cuda", dtype=torch.bfloat16)
        sl = torch.full((b,), L, device="cuda", dtype=torch.int32)
        tables = {
            "shuf": torch.randperm(pool, device="cuda")[: b * nb].to(torch.int32).view(b, nb),
            "fresh": engine_block_tables(b, L, pool, churn=False),
            "churned": engine_block_tables(b, L, pool, churn=True),
            "fresh-lru": engine_block_tables(b, L, pool, churn=False, locality_tokens=0),
            "churn-lru": engine_block_tables(b, L, pool, churn=True, locality_tokens=0),
        }
        tables["order"] = pages_in_order(tables["shuf"])
        kk = kc[tables["churned"].long()].flatten(1, 2).transpose(1, 2).contiguous()
        vv = vc[tables["churned"].long()].flatten(1, 2).transpose(1, 2).contiguous()
        q4 = q.view(b, HQ, 1, D)
        sp = fd.choose_num_splits(b, HKV, L, sms)
        ref = torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True).view(b, HQ, D)
        err = (fd.flash_decode(q, kc, vc, tables["churned"], sl, sc, num_splits=sp).float() - ref.float()).abs().max()
        print(f"{shape}: splits {sp}, pool {pool} blocks; max |ours(churned) - cuDNN| = {err.item():.3g}; "
              + ", ".join(f"{k} {regions(t):.1f} regions/seq" for k, t in tables.items()), flush=True)
        fns = {"cudnn": lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)}
        for name, t in tables.items():
            fns[name] = lambda t=t: fd.flash_decode(q, kc, vc, t, sl, sc, num_splits=sp)
        res = {k: [] for k in fns}
        for _ in range(a.rounds):
            for k, fn in fns.items():
                res[k].append(timed(fn))
        med = {k: statistics.median(v) for k, v in res.items()}
        for k, v in med.items():
            print(f"  {k:<10}{v:>8.1f} us  cudnn/this {med['cudnn'] / v:5.3f}  rounds "
                  + " ".join(f"{x:.1f}" for x in res[k]), flush=True)
        summary.append((shape, med))
        del kc, vc, kk, vv, fns, tables
        torch.cuda.empty_cache()
    cols = ["shuf", "fresh", "churned", "fresh-lru", "churn-lru", "order"]
    print("\nshape         cudnn  " + " ".join(f"{c:>9}" for c in cols) + "   (us; then cudnn/this)")
    for shape, m in summary:
        print(f"{shape:<12}{m['cudnn']:>7.1f}  " + " ".join(f"{m[c]:>9.1f}" for c in cols)
              + "   " + " ".join(f"{m['cudnn'] / m[c]:.3f}" for c in cols))


if __name__ == "__main__":
    main()
