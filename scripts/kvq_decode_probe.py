"""H100 probe: Flash-Decoding over a quantized KV cache (int8 / fp8 codes + a float32 scale per token
and KV head) at the W-attn-decode shapes, over tile configs (BLOCK_N, num_warps, num_stages) and split
counts; bf16 with its own config beside it. Prints GB/s of the bytes each reads and the best config
per (shape, code). Usage: [KVQ_CONFIGS="128,4,3 128,4,4"] PYTHONPATH=. python scripts/kvq_decode_probe.py [out.json]"""

import json
import os
import sys

import torch

from pageflash.bench.kernels import DECODE_HEADS, DECODE_SHAPES, PAGE, _bench, copy_bandwidth, decode_case
from pageflash.kernels.flash_decoding import choose_num_splits, flash_decode
from pageflash.layers.attention import quantize_kv_ref

CONFIGS = [(64, 4, 1), (64, 4, 2), (64, 8, 2), (128, 4, 1), (128, 4, 2), (128, 8, 1), (128, 8, 2), (128, 4, 3),
           (256, 8, 1), (256, 8, 2)]
if os.environ.get("KVQ_CONFIGS"):  # e.g. "128,4,3 128,4,4 128,8,3": BLOCK_N,num_warps,num_stages each
    CONFIGS = [tuple(int(v) for v in c.split(",")) for c in os.environ["KVQ_CONFIGS"].split()]


def main() -> None:
    hq, hkv, d = DECODE_HEADS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    print(f"copy {bw:.0f} GB/s", flush=True)
    out = []
    for b, L in DECODE_SHAPES:
        q, kc, vc, bt, sl = decode_case(b, L)
        nb = bt.shape[1]
        splits = choose_num_splits(b, hkv, nb * PAGE, sms)
        bf_bytes = 2 * b * L * hkv * d * 2
        torch.cuda.synchronize()
        ms = _bench(lambda: flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits), graph=True)
        row = {"shape": [b, L], "splits": splits, "bf16_us": ms * 1e3, "bf16_GBs": bf_bytes / ms / 1e6}
        for name, code in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            kq, ks = quantize_kv_ref(kc, code)
            vq, vs = quantize_kv_ref(vc, code)
            sc = (ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous())
            qbytes = 2 * b * L * hkv * (d * code.itemsize + 4)
            res = {}
            for bn, w, st in CONFIGS:
                cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=st, BT_AHEAD=1, STRIDED=True)
                for sp in sorted({splits, max(1, splits // 2), splits * 2} if splits > 1 else {1, 2}):
                    torch.cuda.synchronize()
                    try:
                        t = _bench(lambda: flash_decode(q, kq, vq, bt, sl, d**-0.5, num_splits=sp, config=cfg,
                                                        kv_scales=sc), graph=True)
                    except Exception as e:  # out of shared memory etc.
                        print(f"  {name} {cfg} sp{sp}: {type(e).__name__}", flush=True)
                        continue
                    res[f"n{bn} w{w} s{st} sp{sp}"] = t * 1e3
            best = min(res, key=res.get)
            row[name] = res
            row[f"{name}_best"] = [best, res[best], qbytes / res[best] / 1e3]
            print(f"B{b} L{L} {name}: bf16 {row['bf16_us']:.1f} us ({row['bf16_GBs']:.0f} GB/s); "
                  f"default n64 w4 s1 sp{splits} {res.get(f'n64 w4 s1 sp{splits}', float('nan')):.1f} us; "
                  f"best {best} {res[best]:.1f} us ({qbytes / res[best] / 1e3:.0f} GB/s, "
                  f"{100 * qbytes / res[best] / 1e3 / bw:.0f}% copy, {row['bf16_us'] / res[best]:.2f}x bf16)",
                  flush=True)
            del kq, vq, sc
        out.append(row)
        del q, kc, vc
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
    print("\nall configs (us):")
    for row in out:
        for name in ("int8", "fp8"):
            print(f"B{row['shape'][0]} L{row['shape'][1]} {name}: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in sorted(row[name].items(), key=lambda kv: kv[1])[:8]))


if __name__ == "__main__":
    main()
