"""LoRA shrink / expand tiles at llama-3-8b's projections (GPU): each config's time per launch inside
a CUDA graph of back-to-back launches (what a decode graph pays), against the current
``shrink_config`` / ``expand_config``.

    python scripts/lora_tiles_probe.py [--tokens 1 4 16 64 256] [--rank 16] [--slots 2] [--json F]

All T tokens use slot 1 (the worst case: every token has the adapter). The shrink sweeps BLOCK_M,
BLOCK_N, BLOCK_K, split_k, warps and stages; the expand then sweeps BLOCK_M, BLOCK_N, warps and
stages over the partials of the best shrink (its split_k). Prints, per (projection, T), the current
configs' times and the best found, and a last table of the sums over the four projections (what a
layer pays).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from pageflash.bench.moe import graph_time_us
from pageflash.kernels.host_math import next_pow2
from pageflash.kernels.lora_expand import expand_config, lora_expand
from pageflash.kernels.lora_shrink import lora_shrink, shrink_config
from pageflash.lora.layers import group_by_slot

# (name, K, slices of the output) at llama-3-8b
SHAPES = [("qkv", 4096, [4096, 1024, 1024]), ("o", 4096, [4096]), ("gate_up", 4096, [14336, 14336]),
          ("down", 14336, [4096])]


def time_graph(fn, launches: int = 20, reps: int = 5) -> float:
    """µs per launch of fn, from replays of a graph of `launches` calls (median of reps)."""
    return graph_time_us(fn, iters=launches, reps=reps)


def shrink_configs(t: int, r: int, k: int):
    for bm, bn, bk, sk, w, st in itertools.product((16, 32, 64), (16, 32, 64), (64, 128, 256),
                                                   (1, 2, 4, 8, 16, 32), (2, 4), (2, 3)):
        if bm > max(16, next_pow2(t)) or bn > max(16, next_pow2(r)) or k // sk < bk:
            continue
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, split_k=sk, num_warps=w, num_stages=st)


def expand_configs(t: int, rank: int):
    for bm, bn, w, st in itertools.product((16, 32, 64), (32, 64, 128, 256), (2, 4, 8), (1, 2, 3)):
        if bm > max(16, next_pow2(t)):
            continue
        yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_R=min(64, max(16, next_pow2(rank))), num_warps=w, num_stages=st)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    rows, totals = [], {}
    for t in args.tokens:
        slots = torch.ones(t, dtype=torch.int32, device=dev)
        groups = group_by_slot(slots, args.slots)
        for name, k, slices in SHAPES:
            r = len(slices) * args.rank
            n = sum(slices)
            x = torch.randn(t, k, device=dev, dtype=dt)
            a = torch.randn(args.slots, r, k, device=dev, dtype=dt) * 0.02
            scale = torch.ones(args.slots, len(slices), device=dev)
            b = torch.randn(args.slots, n, args.rank, device=dev, dtype=dt) * 0.02
            out = torch.zeros(t, n, device=dev, dtype=dt)

            def shrink(cfg):
                return lora_shrink(x, a, scale, *groups, config=cfg)

            cur_s = shrink_config(t, r, k)
            t_cur_s = time_graph(lambda: shrink(cur_s))
            best_s, t_best_s = cur_s, t_cur_s
            for cfg in shrink_configs(t, r, k):
                try:
                    us = time_graph(lambda: shrink(cfg))
                except Exception as e:  # (out of shared memory, ...)
                    print(f"  skip shrink {cfg}: {type(e).__name__}")
                    continue
                if us < t_best_s:
                    best_s, t_best_s = cfg, us
            ref = shrink(cur_s).sum(0)
            got = shrink(best_s).sum(0)
            assert torch.allclose(ref, got, rtol=1e-2, atol=1e-2), f"shrink {name} T={t}: best config disagrees"
            p_cur = shrink(cur_s)
            p_best = shrink(best_s)
            cur_e = expand_config(t, args.rank, sum(slices))
            t_cur_e = time_graph(lambda: lora_expand(p_cur, b, *groups, out, slices, config=cur_e))
            best_e, t_best_e = cur_e, time_graph(lambda: lora_expand(p_best, b, *groups, out, slices, config=cur_e))
            t_cur_e_best_p = t_best_e
            for cfg in expand_configs(t, args.rank):
                try:
                    us = time_graph(lambda: lora_expand(p_best, b, *groups, out, slices, config=cfg))
                except Exception as e:
                    print(f"  skip expand {cfg}: {type(e).__name__}")
                    continue
                if us < t_best_e:
                    best_e, t_best_e = cfg, us
            row = dict(name=name, T=t, shrink_cur=t_cur_s, shrink_best=t_best_s, shrink_cfg=best_s,
                       expand_cur=t_cur_e, expand_cur_on_best_p=t_cur_e_best_p, expand_best=t_best_e,
                       expand_cfg=best_e, cur_shrink_cfg=cur_s)
            rows.append(row)
            tot = totals.setdefault(t, [0.0, 0.0])
            tot[0] += t_cur_s + t_cur_e
            tot[1] += t_best_s + t_best_e
            print(f"{name:8s} T={t:4d} shrink {t_cur_s:6.2f} -> {t_best_s:6.2f} us {best_s} | expand {t_cur_e:6.2f} "
                  f"({t_cur_e_best_p:6.2f} on best p) -> {t_best_e:6.2f} us {best_e}", flush=True)
    print("\nT, current shrink+expand us per layer (4 projections), best, ratio")
    for t, (c, bst) in totals.items():
        print(f"{t:4d} {c:7.2f} {bst:7.2f} {c / bst:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)




def pipeline_main(argv=None) -> None:
    """--pipeline: the LoRA cost inside a layer-like graph, as the engine's decode graphs run it: per
    projection the shrink on a side stream beside the base GEMM (F.linear), the expand after both;
    8 layers of the 4 projections with their own weights. Variants: no LoRA, the current configs,
    and tuned tiles at split_k 4 / 8 / 16 / 32 (shrink BLOCK_K 128, 4 warps, 3 stages; expand
    BLOCK_N 128, 256 from 16384 outputs, 8 warps, 2 stages)."""
    import torch.nn.functional as F

    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", action="store_true")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4, 16, 64, 256])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=["4", "8", "16", "32"],
                    help="split_k, or split_k,expand BLOCK_N,expand warps")
    args = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    side = torch.cuda.Stream()

    def tuned(t, r, k, n, variant):
        split, bn, warps = variant if isinstance(variant, tuple) else (variant, None, 8)
        bm = 16 if t <= 64 else 64
        s = dict(BLOCK_M=bm, BLOCK_N=min(64, max(16, next_pow2(r))) if t <= 16 else 16, BLOCK_K=128,
                 split_k=max(1, min(split, k // 128)), num_warps=4, num_stages=3)
        e = dict(BLOCK_M=16 if t <= 64 else 32, BLOCK_N=bn or (256 if n >= 16384 else 128),
                 BLOCK_R=min(64, max(16, next_pow2(args.rank))), num_warps=warps, num_stages=2)
        return s, e

    for t in args.tokens:
        groups = group_by_slot(torch.ones(t, dtype=torch.int32, device=dev), 2)
        layers = []
        for _ in range(args.layers):
            for name, k, slices in SHAPES:
                n, r = sum(slices), len(slices) * args.rank
                layers.append(dict(k=k, n=n, r=r, slices=slices, x=torch.randn(t, k, device=dev, dtype=dt),
                                   w=torch.randn(n, k, device=dev, dtype=dt) * 0.02,
                                   a=torch.randn(2, r, k, device=dev, dtype=dt) * 0.02,
                                   s=torch.ones(2, len(slices), device=dev),
                                   b=torch.randn(2, n, args.rank, device=dev, dtype=dt) * 0.02))

        def run(variant):
            for L in layers:
                if variant is None:
                    F.linear(L["x"], L["w"])
                    continue
                if variant == "cur":
                    sc, ec = shrink_config(t, L["r"], L["k"]), expand_config(t, args.rank, L["n"])
                else:
                    sc, ec = tuned(t, L["r"], L["k"], L["n"], variant)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    p = lora_shrink(L["x"], L["a"], L["s"], *groups, config=sc)
                y = F.linear(L["x"], L["w"])
                torch.cuda.current_stream().wait_stream(side)
                lora_expand(p, L["b"], *groups, y, L["slices"], config=ec)

        res = {}
        VARIANTS = [None, "cur"] + [tuple(int(f) for f in v.split(",")) if "," in v else int(v) for v in args.variants]
        for _ in range(2):  # two alternated rounds
            for v in VARIANTS:
                res.setdefault(v, []).append(time_graph(lambda: run(v), launches=1, reps=10) / args.layers)
        base = min(res[None])
        line = " ".join(f"{str(v):>4s} {min(ts):7.1f} (+{min(ts) - base:5.1f})" for v, ts in res.items())
        print(f"T={t:4d} us per layer: {line}", flush=True)


if __name__ == "__main__":
    import sys

    pipeline_main() if "--pipeline" in sys.argv else main()
