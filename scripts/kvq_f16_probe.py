"""H100 probe (run 50): Flash-Decoding over int8 / e4m3 caches, the codes widened to bfloat16 (q's dtype,
the default) or to float16 (F16_CODES: q converted once), over a few tile configs, at W-attn-decode's
shapes for two head shapes (run 50's variant probe: e4m3 reads its bytes at 56-73% of copy bandwidth
against int8's 65-87%, and at D 64 both quantized caches were slower than bf16 at batch 1).
    python scripts/kvq_f16_probe.py [HQ,HKV,D ...]"""
import os
import sys

import torch

import pageflash.bench.kernels as bk
from pageflash.kernels.flash_decoding import choose_num_splits, decode_config, flash_decode
from pageflash.layers.attention import quantize_kv_ref

CONFIGS = [(64, 2, 3), (64, 4, 2), (128, 4, 2), (128, 4, 3), (128, 2, 3), (256, 4, 2)]
if os.environ.get("KVQ_CONFIGS"):  # e.g. "64,2,3 128,4,3": BLOCK_N,num_warps,num_stages each
    CONFIGS = [tuple(int(v) for v in c.split(",")) for c in os.environ["KVQ_CONFIGS"].split()]

if __name__ == "__main__":
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = bk.copy_bandwidth()
    print(f"copy {bw:.0f} GB/s", flush=True)
    summary = []
    for heads in sys.argv[1:] or ["32,8,128", "9,3,64"]:
        hq, hkv, d = (int(x) for x in heads.split(","))
        bk.DECODE_HEADS = (hq, hkv, d)
        shapes = bk.DECODE_SHAPES
        if os.environ.get("SHAPES"):  # e.g. "256x1024 1x32768"
            shapes = [tuple(int(v) for v in x.split("x")) for x in os.environ["SHAPES"].split()]
        for b, L in shapes:
            q, kc, vc, bt, sl = bk.decode_case(b, L)
            nb = bt.shape[1]
            sp = choose_num_splits(b, hkv, nb * bk.PAGE, sms)
            bcfg = decode_config(d, q.dtype, q.device, sp > 1)
            t_bf = bk._bench(lambda: flash_decode(q, kc, vc, bt, sl, d ** -0.5, num_splits=sp), graph=True) * 1e3
            ref = flash_decode(q, kc, vc, bt, sl, d ** -0.5, num_splits=1).float()
            for name, code in (("int8", torch.int8), ("e4m3", torch.float8_e4m3fn)):
                kq, ks = quantize_kv_ref(kc, code)
                vq, vs = quantize_kv_ref(vc, code)
                scl = (ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous())
                nbytes = 2 * b * L * hkv * (d + 4)
                res = {}
                for bn, w, st in CONFIGS:
                    for f16 in (False, True):
                        cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=st, BT_AHEAD=1, STRIDED=True, F16_CODES=f16)
                        for s in sorted({sp, max(1, sp // 2)}):
                            fn = (lambda cfg=cfg, s=s: flash_decode(q, kq, vq, bt, sl, d ** -0.5, num_splits=s,
                                                                   config=cfg, kv_scales=scl))
                            try:
                                torch.cuda.synchronize()
                                err = (fn().float() - ref).abs().max().item()
                                t = bk._bench(fn, graph=True) * 1e3
                            except Exception as e:  # out of shared memory etc.
                                print(f"  {name} {cfg} sp{s}: {type(e).__name__}", flush=True)
                                continue
                            res[f"n{bn} w{w} s{st} sp{s}{' f16' if f16 else ''}"] = (t, err)
                dflt = f"n{CONFIGS[0][0]} w{CONFIGS[0][1]} s{CONFIGS[0][2]} sp{sp}"
                best = min((k for k in res if not k.endswith("f16")), key=lambda k: res[k][0])
                best16 = min((k for k in res if k.endswith("f16")), key=lambda k: res[k][0])
                line = (f"{hq}/{hkv}x{d} B{b} L{L} {name}: bf16 {t_bf:.1f} us (cfg n{bcfg['BLOCK_N']}); "
                        f"default {dflt} {res[dflt][0]:.1f} us ({100 * nbytes / res[dflt][0] / 1e3 / bw:.0f}%), "
                        f"f16 same cfg {res[dflt + ' f16'][0]:.1f}; best {best} {res[best][0]:.1f} "
                        f"({100 * nbytes / res[best][0] / 1e3 / bw:.0f}%); best f16 {best16} {res[best16][0]:.1f} "
                        f"({100 * nbytes / res[best16][0] / 1e3 / bw:.0f}%); max err {max(v[1] for v in res.values()):.3f}")
                print(line, flush=True)
                summary.append(line)
                for k, (t, e) in sorted(res.items(), key=lambda kv: kv[1][0]):
                    print(f"    {k:<24}{t:8.1f} us  err {e:.3f}", flush=True)
    print("\nSUMMARY")
    print("\n".join(summary))
