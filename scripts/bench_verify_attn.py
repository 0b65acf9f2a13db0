"""Verify-step attention (few queries per sequence over a long paged context): time the paged kernel
with the keys split over 1..N programs, block ids loaded in the tile's iteration (a0) or one
iteration ahead (a1, BT_AHEAD). Usage: python scripts/bench_verify_attn.py"""
import torch
import triton.testing

from pageflash.kernels.paged_attention import paged_attention, build_tiles, prefill_config

torch.manual_seed(0)
hq, hkv, d, page = 9, 3, 64, 16
for b, qn, ctx, tree in [(1, 6, 1100, True), (1, 16, 1100, True), (64, 6, 1100, True), (64, 16, 1100, True),
                         (16, 6, 1100, True)]:
    nb = (ctx + qn) // page + 1
    width = 2048 // page
    kc = torch.randn(b * nb + 1, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.zeros(b, width, dtype=torch.int32, device="cuda")
    bt[:, :nb] = torch.randperm(b * nb + 1, device="cuda")[: b * nb].to(torch.int32).view(b, nb)
    sl = torch.full((b,), ctx + qn, dtype=torch.int32, device="cuda")
    qsl = torch.arange(b + 1, dtype=torch.int32, device="cuda") * qn
    q = torch.randn(b * qn, hq, d, device="cuda", dtype=torch.bfloat16)
    mask = torch.tril(torch.ones(qn, 16, dtype=torch.uint8, device="cuda")).repeat(b, 1)
    cfg = prefill_config(d, hq // hkv, qn, q.dtype, q.device)
    tiles = build_tiles([qn] * b, [ctx + qn] * b, cfg["BLOCK_M"] // 4, q.device)
    res = []
    for s in (1, 2, 4, 8, 16):
        for a in (0, 1):
            c = dict(cfg, BT_AHEAD=a)
            f = lambda: paged_attention(q, kc, vc, qsl, sl, bt, 0.125, [qn] * b, [ctx + qn] * b, tree_mask=mask,
                                        tiles=tiles, config=c, num_splits=s)
            f()
            torch.cuda.synchronize()
            res.append(f"sp{s} a{a} {triton.testing.do_bench_cudagraph(f, rep=50) * 1e3:.1f}us")
    print(f"B{b} Q{qn} ctx{ctx} tiles {tiles[0].numel()} cfg {cfg['BLOCK_M']}x{cfg['BLOCK_N']}: " + ", ".join(res), flush=True)
