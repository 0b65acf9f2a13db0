"""H100 probe: the paged prefill kernel over a quantized KV cache in a W-offline-like mixed step
(decode sequences with 300-1500 keys beside a 1024-token prefill chunk; KVQ_STEP=chunks: four
1024-token chunks over 1024 cached tokens), llama-3-8b heads, over tile configs; bf16 beside it. Usage: [KVQ_CONFIGS="128,64,8,3 64,64,4,3"] PYTHONPATH=. python scripts/kvq_paged_probe.py"""

import os

import torch

from pageflash.bench.kernels import _bench
from pageflash.kernels.paged_attention import build_tiles, paged_attention, prefill_config
from pageflash.layers.attention import quantize_kv_ref

from mixed_step_probe import step_metadata  # (scripts/ is on the path when this file runs)

HQ, HKV, D, PAGE = 32, 8, 128, 16
CONFIGS = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (128, 128, 4, 3), (128, 128, 8, 4)]
if os.environ.get("KVQ_CONFIGS"):  # "BLOCK_M,BLOCK_N,num_warps,num_stages ..."
    CONFIGS = [tuple(int(v) for v in c.split(",")) for c in os.environ["KVQ_CONFIGS"].split()]


def main() -> None:
    g = torch.Generator().manual_seed(0)
    specs = [(int(c), 1) for c in torch.randint(300, 1500, (240,), generator=g)] + [(512, 1024)]
    if os.environ.get("KVQ_STEP") == "chunks":  # prefill chunks only: 4 x 1024 new tokens over 1024 cached
        specs = [(1024, 1024)] * 4
    meta, total = step_metadata(specs, g)
    bt, qsl, sl, qlens, lens = meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.query_lens_cpu, \
        meta.seq_lens_cpu
    kc = torch.randn(total, PAGE, HKV, D, device="cuda").to(torch.bfloat16)
    vc = torch.randn_like(kc)
    t = sum(qlens)
    q = torch.randn(t, HQ, D, device="cuda").to(torch.bfloat16)
    keys = sum(lens)
    base = prefill_config(D, HQ // HKV, max(qlens), torch.bfloat16, q.device)
    caches = {"bf16": (kc, vc, None)}
    for name, code in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        kq, ks = quantize_kv_ref(kc, code)
        vq, vs = quantize_kv_ref(vc, code)
        caches[name] = (kq, vq, (ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()))
    for name, (k_, v_, sc) in caches.items():
        per_key = HKV * D * 2 * (2 if sc is None else 1) + (0 if sc is None else HKV * 8)
        res = {}
        for bm, bn, w, st in CONFIGS:
            cfg = dict(base, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
            tiles = build_tiles(qlens, lens, cfg["BLOCK_M"] // 4, q.device)
            torch.cuda.synchronize()
            try:
                ms = _bench(lambda: paged_attention(q, k_, v_, qsl, sl, bt, D**-0.5, qlens, lens, tiles=tiles,
                                                    config=cfg, kv_scales=sc), graph=True)
            except Exception as e:
                print(f"{name} m{bm} n{bn} w{w} s{st}: {type(e).__name__}")
                continue
            res[f"m{bm} n{bn} w{w} s{st}"] = ms * 1e3
        print(f"{name}: " + ", ".join(f"{k} {v:.1f} us ({keys * per_key / v / 1e3:.0f} GB/s)"
                                      for k, v in sorted(res.items(), key=lambda kv: kv[1])), flush=True)


if __name__ == "__main__":
    main()
