"""Weight-only INT8 linear kernels on the GPU, against bf16 in the same process.
Usage: PYTHONPATH=. python scripts/w8_probe.py [OUT_JSON]

For each llama-3-8b projection and rows M of x, times (cold L2, kernels/skinny_gemm._bench_cold):
- bf16: cuBLAS (F.linear) and, at M <= 4, the bf16 GEMV (kernels/gemv.py);
- int8: the GEMV with a scale over several tiles (M <= 4); w8_gemm over a config sweep; the
  dequantize-then-cuBLAS path; torch's own _weight_int8pack_mm where it runs on CUDA (a peer).
Checks each int8 result against the float32 reference first. Prints one row per (shape, M): the best
bf16, the default int8 path, the best int8 candidate, and int8 GB/s (codes + scales over time).
"""

import json
import os
import sys

import torch

from pageflash.kernels.gemv import gemv
from pageflash.kernels import skinny_gemm as sg
from pageflash.kernels.skinny_gemm import _bench_cold
from pageflash.kernels.w8_linear import (GEMV_MAX_ROWS, _gemm_config, dequantize_int8,
                                         dequantize_int8_fast, quantize_int8, w8_gemm,
                                         w8_gemv_cfg, w8_linear, w8_linear_ref)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = [int(v) for v in os.environ.get("W8_MS", "1 2 4 8 16 32 64 128 256 512 2048 8192").split()]
GEMV_CFGS = [(8, 4, 512, 4, 4), (8, 8, 512, 4, 4), (16, 8, 512, 4, 4), (8, 8, 1024, 4, 4), (16, 8, 1024, 4, 4),
             (16, 16, 512, 4, 8), (8, 8, 512, 6, 4), (16, 8, 1024, 3, 8), (32, 8, 512, 4, 4), (16, 16, 1024, 3, 8),
             (8, 8, 256, 8, 4), (16, 8, 512, 6, 8)]
GEMM_BY_M = [  # (largest M, configs (BM, BN, BK, GROUP_M, num_warps, num_stages))
    (16, [(16, 32, 256, 1, 4, 4), (16, 64, 256, 1, 4, 4), (16, 128, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4),
          (16, 32, 512, 1, 4, 3)]),
    (32, [(32, 64, 128, 1, 4, 4), (16, 32, 256, 16, 4, 4), (32, 64, 256, 1, 4, 3), (32, 128, 128, 1, 4, 4),
          (16, 64, 256, 16, 4, 4)]),
    (64, [(64, 64, 256, 1, 4, 3), (64, 32, 256, 1, 4, 4), (64, 128, 128, 1, 4, 3), (32, 64, 256, 2, 4, 3),
          (64, 64, 128, 1, 4, 4), (32, 128, 128, 2, 4, 4)]),
    (256, [(128, 64, 128, 8, 4, 4), (64, 64, 128, 1, 4, 4), (64, 128, 128, 8, 4, 4), (128, 128, 64, 8, 8, 4),
           (128, 128, 128, 8, 8, 3), (64, 64, 256, 1, 4, 3), (64, 128, 256, 8, 8, 3)]),
    (512, [(128, 128, 64, 8, 4, 4), (128, 128, 128, 8, 8, 3)]),
    (1 << 30, [(128, 128, 64, 8, 4, 4), (256, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 128, 128, 8, 8, 3),
               (128, 128, 64, 8, 8, 4)]),
]


def main():
    dev = "cuda"
    flush = torch.empty(64 << 20, dtype=torch.float16, device=dev)
    torch.manual_seed(0)
    int8pack = hasattr(torch, "_weight_int8pack_mm")
    rows, log = [], []
    for name, (n, k) in SHAPES.items():
        wb = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        q, s = quantize_int8(wb)
        nbytes = q.numel() + 4 * s.numel()
        for m in MS:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = w8_linear_ref(x.float(), q, s)
            tol = 1e-2 * ref.abs().max().item() + 1e-3

            def ok(y):
                return (y.float() - ref).abs().max().item() <= tol

            bf = {"cublas": _bench_cold(lambda: torch.nn.functional.linear(x, wb), flush)}
            if m <= 4:
                bf["gemv"] = _bench_cold(lambda: gemv(x, wb, 16, *sg.gemv_tile(x.device)), flush)
            cand = {}
            if m <= 4:
                for c in GEMV_CFGS:
                    try:
                        if ok(gemv(x, q, *c, scale=s)):
                            cand[f"gemv{c}"] = _bench_cold(lambda: gemv(x, q, *c, scale=s), flush)
                        else:
                            log.append(f"{name} M{m} gemv{c} WRONG")
                    except Exception as e:
                        log.append(f"{name} M{m} gemv{c} {type(e).__name__}: {e}"[:200])
            cfgs = next(c for top, c in GEMM_BY_M if m <= top) if m > 1 else []
            if 32 <= m <= 512:  # split-K: wide tiles, more programs
                cfgs = cfgs + [c + (sk,) for c in cfgs[:3] for sk in (2, 4)] + [
                    (64, 128, 128, 1, 4, 3, 2), (64, 128, 128, 1, 4, 3, 4), (128, 128, 64, 8, 8, 4, 2),
                    (128, 128, 64, 8, 8, 4, 4), (64, 256, 64, 1, 8, 3, 4), (32, 128, 128, 1, 4, 4, 4)]
            for c in cfgs:
                key = f"gemm{c}"
                try:
                    if ok(w8_gemm(x, q, s, config=c)):
                        cand[key] = _bench_cold(lambda: w8_gemm(x, q, s, config=c), flush)
                    else:
                        log.append(f"{name} M{m} {key} WRONG")
                except Exception as e:
                    log.append(f"{name} M{m} {key} {type(e).__name__}: {e}"[:200])
            if m >= 256:
                cand["dequant_fast+cublas"] = _bench_cold(
                    lambda: torch.nn.functional.linear(x, dequantize_int8_fast(q, s, torch.bfloat16)), flush)
            cand["dequant+cublas"] = _bench_cold(
                lambda: torch.nn.functional.linear(x, dequantize_int8(q, s, torch.bfloat16)), flush)
            if int8pack:
                try:
                    s16 = s.to(torch.bfloat16)
                    y = torch._weight_int8pack_mm(x, q, s16)
                    if ok(y):
                        cand["torch_int8pack"] = _bench_cold(lambda: torch._weight_int8pack_mm(x, q, s16), flush)
                except Exception as e:
                    int8pack = False
                    log.append(f"_weight_int8pack_mm: {type(e).__name__}: {e}"[:200])
            assert ok(w8_linear(x, q, s)), (name, m)
            default = _bench_cold(lambda: w8_linear(x, q, s), flush)
            best_k = min(cand, key=cand.get)
            bbest = min(bf.values())
            rows.append(dict(shape=name, m=m, bf16_us=bbest * 1e3, bf16=bf, int8_default_us=default * 1e3,
                             default_cfg=str(w8_gemv_cfg(x.device) if m <= GEMV_MAX_ROWS else _gemm_config(m, n, k)), best=best_k,
                             best_us=cand[best_k] * 1e3, cands={k2: v * 1e3 for k2, v in cand.items()},
                             gbps=nbytes / default / 1e6))
            r = rows[-1]
            print(f"{name:8s} M{m:5d} bf16 {r['bf16_us']:8.1f}  int8 default {r['int8_default_us']:8.1f} "
                  f"({r['gbps']:6.0f} GB/s) x{r['bf16_us'] / r['int8_default_us']:.2f}  best {best_k} "
                  f"{r['best_us']:8.1f}  dequant {cand['dequant+cublas'] * 1e3:8.1f}"
                  + (f"  int8pack {cand['torch_int8pack'] * 1e3:8.1f}" if "torch_int8pack" in cand else ""),
                  flush=True)
    for line in log[:40]:
        print("log:", line)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(dict(rows=rows, log=log, device=torch.cuda.get_device_name()), f, indent=1)


if __name__ == "__main__":
    main()
