"""Probe: decode block ids one per page (BT_PAGES) against one per key, W-attn-decode shapes, over the
whole-pool shuffle, pages in order and the engine allocator's churned tables, cuDNN SDPA on contiguous
KV in the same process; CUDA-graph replays, ROUNDS alternated rounds, medians. Also the quantized
caches (int8 / e4m3) over shuffled pages. Checks every config against the reference first.

Usage: PYTHONPATH=. python scripts/decode_bt_pages_probe.py [ROUNDS]   (GPU)
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.nn.functional as F

from pageflash.bench.kernels import (
    DECODE_HEADS, DECODE_SHAPES, PAGE, _bench, decode_case, decode_config_mismatches, engine_block_tables,
    pages_in_order,
)
from pageflash.kernels.flash_decoding import choose_num_splits, flash_decode
from pageflash.layers.attention import quantize_kv_ref


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    bad = decode_config_mismatches([dict(BT_PAGES=True), dict(BT_PAGES=False)])
    print("config mismatches:", bad, flush=True)
    hq, hkv, d = DECODE_HEADS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    table = []
    for b, L in DECODE_SHAPES:
        q, kc, vc, bt, sl = decode_case(b, L)
        nb = bt.shape[1]
        splits = choose_num_splits(b, hkv, nb * PAGE, sms)
        layouts = {"shuffled": (bt, kc, vc), "in order": (pages_in_order(bt), kc, vc)}
        pool = 2 * b * nb  # the bench's engine-layout pool: twice the batch's blocks
        kc2 = torch.randn(pool, PAGE, hkv, d, device="cuda", dtype=kc.dtype)
        vc2 = torch.randn_like(kc2)
        layouts["churned"] = (engine_block_tables(b, L, pool, churn=True), kc2, vc2)
        kk = torch.randn(b, hkv, L, d, device="cuda", dtype=torch.bfloat16)
        vv = torch.randn_like(kk)
        qs = q.view(b, hq, 1, d)
        cases = {}
        for name, (t, kc_, vc_) in layouts.items():
            for pp in (False, True):
                cases[f"{name} {'page' if pp else 'key'}"] = (
                    lambda t=t, kc_=kc_, vc_=vc_, pp=pp: flash_decode(q, kc_, vc_, t, sl, d**-0.5, num_splits=splits,
                                                                      config=dict(BT_PAGES=pp)))
        for code in (torch.int8, torch.float8_e4m3fn):
            kq, ks = quantize_kv_ref(kc, code)
            vq, vs = quantize_kv_ref(vc, code)
            ks, vs = ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()  # [blocks, Hkv, page]
            for pp in (False, True):
                cases[f"{'int8' if code == torch.int8 else 'e4m3'} shuffled {'page' if pp else 'key'}"] = (
                    lambda kq=kq, vq=vq, ks=ks, vs=vs, pp=pp: flash_decode(
                        q, kq, vq, bt, sl, d**-0.5, num_splits=splits, kv_scales=(ks, vs), config=dict(BT_PAGES=pp)))
        cases["cudnn"] = lambda: F.scaled_dot_product_attention(qs, kk, vv, enable_gqa=True)
        res = {k: [] for k in cases}
        for _ in range(rounds):
            for k, fn in cases.items():
                fn()
                torch.cuda.synchronize()
                res[k].append(_bench(fn, graph=True) * 1e3)
        med = {k: statistics.median(v) for k, v in res.items()}
        table.append(((b, L, splits), med))
        print(f"B{b} L{L} splits {splits}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()), flush=True)
        del q, kc, vc, kk, vv, kc2, vc2, layouts, cases
        torch.cuda.empty_cache()
    keys = list(table[0][1])
    print("\n| B, L (splits) | " + " | ".join(keys) + " |")
    print("| --- |" + " --- |" * len(keys))
    for (b, L, sp), med in table:
        print(f"| {b}, {L} ({sp}) | " + " | ".join(f"{med[k]:.1f}" for k in keys) + " |")
    print("\nratios page / key (< 1: per-page ids faster); cuDNN / ours")
    for (b, L, sp), med in table:
        parts = []
        for lay in ("shuffled", "in order", "churned", "int8 shuffled", "e4m3 shuffled"):
            if f"{lay} key" in med:
                parts.append(f"{lay} {med[lay + ' page'] / med[lay + ' key']:.3f}")
        for lay in ("shuffled", "in order", "churned"):
            if f"{lay} page" in med:
                parts.append(f"cudnn/{lay} page {med['cudnn'] / med[lay + ' page']:.3f}")
        print(f"B{b} L{L}: " + ", ".join(parts))


if __name__ == "__main__":
    main()
