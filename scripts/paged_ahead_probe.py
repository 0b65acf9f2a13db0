"""Paged prefill kernel with block ids loaded one tile ahead (BT_AHEAD=1) or in the tile's own
iteration (0), on the W-attn-prefill shapes (pages shuffled), against the contiguous kernel in the same
process. Prints TFLOP/s per config and the max |difference| to the contiguous kernel's output.
Usage: python scripts/paged_ahead_probe.py"""
import torch
from triton.testing import do_bench

from pageflash.bench.kernels import PREFILL_SHAPES, _paged_from_contiguous
from pageflash.kernels.flash_attention import _fwd
from pageflash.kernels.paged_attention import build_tiles, paged_attention, prefill_config

rows = []
for b, h, n, d in PREFILL_SHAPES:
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    tf = lambda ms: 4 * b * h * n * n * d / 2 / (ms * 1e-3) / 1e12  # noqa: E731
    ref = _fwd(q, k, v, None, n, True, d ** -0.5, False, None)[0]
    res = {"contiguous": tf(do_bench(lambda: _fwd(q, k, v, None, n, True, d ** -0.5, False, None)))}
    kc, vc, bt = _paged_from_contiguous(k, v)
    qf = q.transpose(1, 2).reshape(b * n, h, d)
    qsl = torch.arange(0, (b + 1) * n, n, device="cuda", dtype=torch.int32)
    sl = torch.full((b,), n, device="cuda", dtype=torch.int32)
    base = prefill_config(d, 1, n, q.dtype, q.device)
    cfgs = [dict(base), dict(base, BT_AHEAD=1)]
    for bm, bn, w, s in [(128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 8, 4),
                         (128, 32, 4, 4), (128, 32, 8, 3), (64, 64, 4, 3), (64, 64, 4, 4)]:
        cfgs.append(dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, BT_AHEAD=1))
    for c in cfgs:
        tiles = build_tiles([n] * b, [n] * b, c["BLOCK_M"], q.device)
        f = lambda: paged_attention(qf, kc, vc, qsl, sl, bt, d ** -0.5, [n] * b, [n] * b, tiles=tiles, config=c)  # noqa
        try:
            err = (f().view(b, n, h, d).transpose(1, 2).float() - ref.float()).abs().max().item()
            key = f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']} a{c.get('BT_AHEAD', 0)}"
            res[key] = tf(do_bench(f))
            res[key + " err"] = err
        except Exception as e:  # noqa: BLE001 (e.g. out of shared memory)
            print("  n/a", c, type(e).__name__, str(e)[:100])
    errs = max(v_ for k_, v_ in res.items() if k_.endswith(" err"))
    print(f"B{b} H{h} N{n} D{d}: max err {errs:.3g}; " + ", ".join(f"{k_} {v_:.0f}" for k_, v_ in res.items()
                                                              if not k_.endswith(" err")), flush=True)
