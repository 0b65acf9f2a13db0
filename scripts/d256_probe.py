"""Prefill attention at head_dim 256 (Gemma): the contiguous FA2 kernel's and the paged kernel's tile
configs, against torch SDPA's backends, in TFLOP/s (causal, bf16; pages shuffled for the paged kernel).
Shapes: gemma-2-9b's heads (16 over 8) over one 8192-token prompt, gemma-3-4b's (8 over 4) over 4 x
4096. Prints one line per shape, the current config first; max |difference| to SDPA's output.
Usage: python scripts/d256_probe.py"""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from pageflash.bench.kernels import _paged_from_contiguous
from pageflash.kernels.flash_attention import _fwd, fwd_config
from pageflash.kernels.paged_attention import build_tiles, paged_attention, prefill_config

FWD = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3),
       (128, 32, 8, 3), (64, 64, 4, 1), (128, 64, 8, 1)]
for b, hq, hkv, n in [(1, 16, 8, 8192), (4, 8, 4, 4096)]:
    d = 256
    torch.manual_seed(0)
    q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    tf = lambda ms: 4 * b * hq * n * n * d / 2 / (ms * 1e-3) / 1e12  # noqa: E731
    res, errs = {}, []
    for name, be in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("sdpa-eff", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(be):
                f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # noqa
                ref = f()
                res[name] = tf(do_bench(f))
        except Exception as e:  # noqa: BLE001
            print("  n/a", name, type(e).__name__, str(e)[:80])
    cur = fwd_config(d, q.dtype, q.device)
    for bm, bn, w, s in [(cur["BLOCK_M"], cur["BLOCK_N"], cur["num_warps"], cur["num_stages"])] + FWD:
        c = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
        try:
            f = lambda: _fwd(q, k, v, None, n, True, d ** -0.5, False, c)  # noqa: E731
            errs.append((f()[0].float() - ref.float()).abs().max().item())
            res[f"fa {bm}x{bn} w{w} s{s}"] = tf(do_bench(f))
        except Exception as e:  # noqa: BLE001 (out of shared memory)
            print("  n/a fa", c, type(e).__name__, str(e)[:80])
    kc, vc, bt = _paged_from_contiguous(k, v)
    qf = q.transpose(1, 2).reshape(b * n, hq, d)
    qsl = torch.arange(0, (b + 1) * n, n, device="cuda", dtype=torch.int32)
    sl = torch.full((b,), n, device="cuda", dtype=torch.int32)
    base = prefill_config(d, hq // hkv, n, q.dtype, q.device)
    for bm, bn, w, s in [(base["BLOCK_M"], base["BLOCK_N"], base["num_warps"], base["num_stages"])] + FWD:
        c = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s, BT_AHEAD=1)
        tiles = build_tiles([n] * b, [n] * b, bm // (hq // hkv), q.device)
        f = lambda: paged_attention(qf, kc, vc, qsl, sl, bt, d ** -0.5, [n] * b, [n] * b, tiles=tiles, config=c)  # noqa
        try:
            errs.append((f().view(b, n, hq, d).transpose(1, 2).float() - ref.float()).abs().max().item())
            res[f"paged {bm}x{bn} w{w} s{s}"] = tf(do_bench(f))
        except Exception as e:  # noqa: BLE001
            print("  n/a paged", c, type(e).__name__, str(e)[:80])
    print(f"B{b} H{hq}/{hkv} N{n} D{d}: max err {max(errs):.3g}; "
          + ", ".join(f"{k_} {v_:.0f}" for k_, v_ in res.items()), flush=True)
