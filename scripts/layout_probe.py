"""Does the KV cache's physical layout matter for paged decode? W-attn-decode shapes, the same
flash_decode kernel over (a) the current layout [blocks, block_size, Hkv, D] (a head's 16 rows of a
block are 256-byte pieces 2 KB apart) and (b) [blocks, Hkv, block_size, D] seen through a permuted
view of the same logical shape (a head's block is one 4 KB piece), plus a few configs, against SDPA
(default backend) on contiguous KV, all as CUDA-graph replays in one run.
Usage: python scripts/layout_probe.py"""

import torch
import torch.nn.functional as F

from pageflash.bench.kernels import DECODE_HEADS, DECODE_SHAPES, PAGE, _bench, _try
from pageflash.kernels.flash_decoding import choose_num_splits, flash_decode

hq, hkv, d = DECODE_HEADS
sms = torch.cuda.get_device_properties(0).multi_processor_count
CFGS = [None, dict(BLOCK_N=128, num_warps=4, num_stages=3), dict(BLOCK_N=128, num_warps=8, num_stages=3),
        dict(BLOCK_N=64, num_warps=4, num_stages=4), dict(BLOCK_N=32, num_warps=4, num_stages=4)]
table = []
for b, L in DECODE_SHAPES:
    torch.manual_seed(0)
    nb = L // PAGE
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    bt = torch.randperm(b * nb + 1, device="cuda")[: b * nb].to(torch.int32).view(b, nb)
    sl = torch.full((b,), L, device="cuda", dtype=torch.int32)
    nbytes = 2 * b * L * hkv * d * 2
    splits = choose_num_splits(b, hkv, nb * PAGE, sms)
    res = {}
    kc0 = torch.randn(b * nb + 1, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc0 = torch.randn_like(kc0)
    outs = {}
    for layout in ("NHD", "HND"):
        if layout == "NHD":
            kc, vc = kc0, vc0
        else:  # same values, head-major inside each block
            kc = kc0.transpose(1, 2).contiguous().transpose(1, 2)
            vc = vc0.transpose(1, 2).contiguous().transpose(1, 2)
        torch.cuda.synchronize()
        for ci, cfg in enumerate(CFGS):
            for sp in sorted({splits, max(1, splits // 2), splits * 2}) if ci == 0 else [splits]:
                ms = _try(lambda: _bench(lambda: flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=sp, config=cfg),
                                         graph=True))
                name = f"{layout} {'default' if cfg is None else 'n%d w%d s%d' % (cfg['BLOCK_N'], cfg['num_warps'], cfg['num_stages'])} sp{sp}"
                res[name] = ms * 1e3 if ms else None
        outs[layout] = flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits)
        kc = vc = None  # free the HND copy before the next shape
    kk = kc0[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
    vv = vc0[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
    del kc0, vc0
    torch.cuda.empty_cache()
    diff = (outs["NHD"].float() - outs["HND"].float()).abs().max().item()
    q4 = q.view(b, hq, 1, d)
    sdpa = lambda: F.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)  # noqa: E731
    sdpa()
    torch.cuda.synchronize()
    res["SDPA default"] = _bench(sdpa, graph=True) * 1e3
    kk = vv = None
    torch.cuda.empty_cache()
    gbs = {k: nbytes / (v * 1e-6) / 1e9 for k, v in res.items() if v}
    print(f"\nB{b} L{L} (splits {splits}); max |HND - NHD| {diff}", flush=True)
    for k, v in sorted(res.items(), key=lambda kv: kv[1] or 1e9):
        print(f"  {k:28s} {v:8.1f} us  {gbs[k]:6.0f} GB/s  SDPA/this {res['SDPA default'] / v:.3f}", flush=True)
    best = {lay: min((v, k) for k, v in res.items() if v and k.startswith(lay)) for lay in ("NHD", "HND")}
    table.append((b, L, res["NHD default sp%d" % splits], best["NHD"], res["HND default sp%d" % splits], best["HND"],
                  res["SDPA default"]))

print("\n| B, L | NHD default us | NHD best | HND default us | HND best | SDPA default us |")
for b, L, nd, nbst, hd, hbst, s in table:
    print(f"| {b}, {L} | {nd:.1f} | {nbst[0]:.1f} ({nbst[1]}) | {hd:.1f} | {hbst[0]:.1f} ({hbst[1]}) | {s:.1f} |")
