"""Probe: where the paged prefill kernel's ~20% against the contiguous FA2 forward goes (W-attn-prefill
shapes, causal bf16, MHA as the bench runs it).

Times (do_bench, median) the contiguous forward and the paged kernel over shuffled 16-token pages,
with the block ids gathered one per key and loaded one per page (BT_PAGES), in a few configs; then
prints every compiled variant's registers / spills / shared memory. (Run 51's first version also
timed pages in order and 64-token pages: docs/BENCHMARKS.md.)

Usage: PYTHONPATH=. python scripts/paged_prefill_gap_probe.py [B H N D [HKV]]    (GPU; HKV: GQA, default H)
       PYTHONPATH=. python scripts/paged_prefill_gap_probe.py --ncu NAME B H N D  (one kernel, for ncu)
"""

from __future__ import annotations

import sys

import torch

from pageflash.bench.kernels import _bench
from pageflash.kernels import flash_attention as fa
from pageflash.kernels import paged_attention as pa


def paged_cache(k, v, page, order):
    b, h, n, d = k.shape
    nb = n // page
    perm = torch.randperm(b * nb, device=k.device) if order == "shuffled" else torch.arange(b * nb, device=k.device)
    bt = perm.to(torch.int32).view(b, nb)
    kc = torch.empty(b * nb, page, h, d, device=k.device, dtype=k.dtype)
    vc = torch.empty_like(kc)
    kc[bt.long()] = k.transpose(1, 2).reshape(b, nb, page, h, d)
    vc[bt.long()] = v.transpose(1, 2).reshape(b, nb, page, h, d)
    return kc, vc, bt


def main():
    args = [a for a in sys.argv[1:] if a != "--ncu"]
    ncu = "--ncu" in sys.argv
    name = args.pop(0) if ncu else None
    b, h, n, d, hkv = ((int(x) for x in args + ([] if len(args) > 4 else [args[1]])) if args
                       else (4, 32, 4096, 128, 32))
    torch.manual_seed(0)
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    flops = 4 * b * h * n * n * d / 2
    qf = q.transpose(1, 2).reshape(b * n, h, d).contiguous()
    qsl = torch.arange(0, (b + 1) * n, n, device="cuda", dtype=torch.int32)
    sl = torch.full((b,), n, device="cuda", dtype=torch.int32)
    base = pa.prefill_config(d, h // hkv, n, q.dtype, q.device)
    cases = {"contiguous": (lambda: fa._fwd(q, k, v, None, n, True, d**-0.5, False, None))}
    caches = {}
    for page, order in [(16, "shuffled")]:
        caches[(page, order)] = paged_cache(k, v, page, order)
    variants = [("shuffled16", 16, "shuffled", dict(BT_PAGES=False)),
                ("shuffled16 pages", 16, "shuffled", dict(BT_PAGES=True)),
                ("shuffled16 pages w4", 16, "shuffled", dict(BT_PAGES=True, num_warps=4)),
                ("shuffled16 w4", 16, "shuffled", dict(BT_PAGES=False, num_warps=4)),
                ("shuffled16 pages s2", 16, "shuffled", dict(BT_PAGES=True, num_stages=2)),
                ("shuffled16 s2", 16, "shuffled", dict(BT_PAGES=False, num_stages=2)),
                ("shuffled16 pages n32", 16, "shuffled", dict(BT_PAGES=True, BLOCK_N=32)),
                ("shuffled16 pages m64 w4", 16, "shuffled", dict(BT_PAGES=True, BLOCK_M=64, num_warps=4))]
    for key, page, order, over in variants:
        kc, vc, bt = caches[(page, order)]
        cfg = dict(base)
        cfg.update(over)
        tiles = pa.build_tiles([n] * b, [n] * b, cfg["BLOCK_M"] // pa.next_pow2(h // hkv), q.device)
        cases[key] = (lambda kc=kc, vc=vc, bt=bt, cfg=cfg, tiles=tiles: pa.paged_attention(
            qf, kc, vc, qsl, sl, bt, d**-0.5, [n] * b, [n] * b, tiles=tiles, config=cfg))
    if ncu:
        fn = cases[name]
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    ref = cases["contiguous"]()
    ref = (ref[0] if isinstance(ref, tuple) else ref).transpose(1, 2).reshape(b * n, h, d)
    res = {}
    for key, fn in cases.items():
        try:
            if key != "contiguous":
                err = (fn().float() - ref.float()).abs().max().item()
                assert err < 2e-2, err
            torch.cuda.synchronize()
            res[key] = flops / (_bench(fn) * 1e-3) / 1e12
        except Exception as e:  # a config that does not fit: reported
            print(f"{key}: n/a ({type(e).__name__}: {str(e)[:100]})")
            res[key] = None
        print(f"B{b} H{h} N{n} D{d} {key}: {res[key] and round(res[key])} TFLOP/s", flush=True)
    for label, kern in [("forward", fa._fwd_kernel), ("paged", pa._paged_prefill_kernel)]:
        for key, (ck, _tail) in kern._cache.items():
            kw = dict(key[1])
            cfg = {x: kw.get(x) for x in ("BLOCK_M", "BLOCK_N", "PAGE_SIZE", "BT_AHEAD", "num_warps", "num_stages")
                   if x in kw}
            print(f"{label} {cfg}: {ck.n_regs} regs, {ck.n_spills} spills, {ck.metadata.shared} B shared")
    print("\n| variant | TFLOP/s | x contiguous |\n| --- | --- | --- |")
    for key, r in res.items():
        print(f"| {key} | {r and round(r)} | {r / res['contiguous']:.3f} |" if r else f"| {key} | n/a | |")


if __name__ == "__main__":
    main()
