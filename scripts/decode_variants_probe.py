"""Every variant of the decode split kernel the engine can launch, at the W-attn-decode shapes: plain,
with the step's rotary + K/V store fused (rope), over int8 / e4m3 caches (with and without rope), a
sliding window, a logit softcap. Run 49 found the rope variant register-bound (156 registers a thread,
3 programs an SM instead of 4: 1.3x the plain kernel's time at long contexts); this checks the others.
Prints, per shape, each variant's time and GB/s of the bytes it reads against the plain kernel, then
the registers / spills / shared memory of every compiled variant. One GPU.
    [QCFG='{"BLOCK_N": 64, "num_warps": 2, "num_stages": 3}'] python scripts/decode_variants_probe.py [HQ,HKV,D]
(default 32,8,128: W-attn-decode's heads; QCFG: a config override for the quantized caches' launches)"""
import json
import os
import sys

import torch

import pageflash.kernels.flash_decoding as fd
import pageflash.bench.kernels as bk
from pageflash.bench.kernels import DECODE_SHAPES, PAGE, _bench, copy_bandwidth
from pageflash.layers.attention import quantize_kv_ref

if __name__ == "__main__":
    hq, hkv, d = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "32,8,128").split(","))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bw = copy_bandwidth()
    print(f"heads {hq}/{hkv}x{d}, copy {bw:.0f} GB/s", flush=True)
    rows = []
    for b, L in DECODE_SHAPES:
        if b * L > 8 * 8192 * 4 and d > 128:
            continue
        bk.DECODE_HEADS = (hq, hkv, d)  # decode_case's heads
        q, kc, vc, bt, sl = bk.decode_case(b, L)
        nb = bt.shape[1]
        sc = d ** -0.5
        sp = fd.choose_num_splits(b, hkv, nb * PAGE, sms)
        pos = (sl - 1).long()
        half = d // 2
        inv = 1.0 / (10000 ** (torch.arange(half, device="cuda", dtype=torch.float32) / half))
        ang = torch.arange(L + 1, device="cuda", dtype=torch.float32)[:, None] * inv[None, :]
        cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
        kn = torch.randn(b, hkv, d, device="cuda", dtype=torch.bfloat16)
        vn = torch.randn_like(kn)
        no_slot = torch.full((b,), -1, device="cuda", dtype=torch.int64)
        rope = dict(rope=(pos, cos, sin), k_new=kn, v_new=vn, slot_mapping=no_slot)
        quant = {}
        for name, code in (("int8", torch.int8), ("e4m3", torch.float8_e4m3fn)):
            kq, ks = quantize_kv_ref(kc, code)
            vq, vs = quantize_kv_ref(vc, code)
            quant[name] = (kq, vq, (ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous()))
        win = 4096
        sp_win = fd.choose_num_splits(b, hkv, min(nb * PAGE, win + 64), sms)
        bf = 2 * b * L * hkv * d * 2

        def qbytes(code_bytes, keys=L):
            return 2 * b * keys * hkv * (d * code_bytes + 4)

        cases = {  # name: (fn, bytes read)
            "plain": (lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=sp), bf),
            "rope": (lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=sp, **rope), bf),
            "softcap": (lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=sp, softcap=50.0), bf),
            "softcap+rope": (lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=sp, softcap=50.0, **rope),
                             bf),
        }
        if L > win:
            wb = 2 * b * win * hkv * d * 2
            cases["window"] = (lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=sp_win, window=win), wb)
            cases["window+rope"] = (lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=sp_win, window=win,
                                                            **rope), wb)
        qcfg = json.loads(os.environ.get("QCFG", "null"))
        for name, (kq, vq, scl) in quant.items():
            nbytes = qbytes(kq.element_size())
            cases[name] = (lambda kq=kq, vq=vq, scl=scl: fd.flash_decode(q, kq, vq, bt, sl, sc, num_splits=sp,
                                                                         kv_scales=scl, config=qcfg), nbytes)
            cases[name + "+rope"] = (lambda kq=kq, vq=vq, scl=scl: fd.flash_decode(
                q, kq, vq, bt, sl, sc, num_splits=sp, kv_scales=scl, config=qcfg, **rope), nbytes)
        ref = fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=1).float()
        err = (cases["plain"][0]().float() - ref).abs().max().item()
        assert err < 2e-2, err
        res = {}
        for _ in range(2):
            for k, (fn, _n) in cases.items():
                torch.cuda.synchronize()
                t = _bench(fn, graph=True) * 1e3
                res[k] = min(res.get(k, t), t)
        base = res["plain"]
        print(f"B{b} L{L} splits {sp}:", flush=True)
        for k, (fn, nbytes) in cases.items():
            gbs = nbytes / res[k] / 1e3
            print(f"  {k:<14}{res[k]:8.1f} us {gbs:7.0f} GB/s {100 * gbs / bw:5.0f}% copy  x{res[k] / base:5.2f} plain")
            rows.append((b, L, k, res[k], gbs))
    print("compiled split kernels: ROPE QUANT WINDOW SOFTCAP BLOCK_N warps stages SPLIT -> regs spills shared")
    for key, (ck, _tail) in fd._decode_split_kernel._cache.items():
        kw = dict(key[1])
        print(f"  rope {int(bool(kw.get('ROPE')))} quant {int(bool(kw.get('QUANT')))} win {kw.get('WINDOW')} "
              f"cap {kw.get('SOFTCAP')} n{kw.get('BLOCK_N')} w{kw.get('num_warps')} s{kw.get('num_stages')} "
              f"split {int(bool(kw.get('SPLIT')))}: {ck.n_regs} regs, {ck.n_spills} spills, {ck.metadata.shared} B")
