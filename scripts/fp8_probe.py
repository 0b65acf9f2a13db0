"""FP8 linears on the GPU, against bf16 and INT8 in the same process.
Usage: PYTHONPATH=. python scripts/fp8_probe.py [OUT_JSON]   (FP8_MS="1 2 ..." picks the rows M)

For each llama-3-8b projection and rows M of x, times (cold L2, kernels/skinny_gemm._bench_cold):
- bf16: layers.linear.linear (cuBLAS, or the skinny / GEMV dispatch at M <= 16);
- int8: w8_linear (the weight-only dispatch);
- fp8 weight-only: w8_linear over e4m3 codes (the path below PAGEFLASH_FP8_MM_M);
- fp8 W8A8: fp8_scaled_mm (the activation quantizer + torch._scaled_mm), and _scaled_mm alone;
- fp8 W8A8 in Triton: fp8_mm over a config sweep (activation quantizer included), best and default.
Checks every fp8 result against its float32 reference first. Prints one row per (shape, M) and, per M,
the sum over the four projections (a layer's worth), from which the W8A8 threshold is chosen.
"""

import json
import os
import sys

import torch

from pageflash.kernels import fp8_linear as F8
from pageflash.kernels.skinny_gemm import _bench_cold
from pageflash.kernels.w8_linear import quantize_int8, w8_linear, w8_linear_ref
from pageflash.layers.linear import linear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = [int(v) for v in os.environ.get("FP8_MS", "1 2 4 8 16 32 64 128 256 512 2048 8192").split()]
COLS = ["bf16", "int8", "fp8_wo", "fp8_w8a8", "scaled_mm_only", "triton_default", "triton_best"]


def configs(m, n):
    """(BN, BM, BK, SPLIT_K, num_warps, num_stages) candidates for fp8_mm at M rows."""
    bms = [16] if m <= 16 else [32] if m <= 32 else [64] if m <= 64 else [64, 128]
    out = []
    for bm in bms:
        for bn in (64, 128):
            for bk in (128, 256):
                for st in (3, 4):
                    out.append((bn, bm, bk, 1, 4 if bn * bm <= 64 * 64 else 8, st))
            if n <= 8192 and m <= 128:
                for sk in (2, 4):
                    out.append((bn, bm, 128, sk, 4, 4))
    return out


def main():
    dev = "cuda"
    flush = torch.empty(64 << 20, dtype=torch.float16, device=dev)
    torch.manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        wb = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        qi, si = quantize_int8(wb)
        qf, sf = F8.quantize_fp8(wb)
        for m in MS:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            wo_ref = w8_linear_ref(x.float(), qf, sf).float()
            tol = 1e-2 * wo_ref.abs().max().item() + 1e-3
            assert (w8_linear(x, qf, sf).float() - wo_ref).abs().max().item() <= tol, (name, m, "fp8 weight-only")
            r = F8.fp8_scaled_mm_ref(x, qf, sf).float()
            tol = 3e-2 * r.abs().max().item() + 1e-3  # FP8 GEMMs over long K: see tests/gpu/test_fp8_gpu.py
            err = (F8.fp8_scaled_mm(x, qf, sf).float() - r).abs().max().item()
            if err > tol:
                print(f"{name} M{m} scaled_mm err {err:.4f} > {tol:.4f}", flush=True)
            xq, sx = F8.quantize_rows_fp8(x)
            t = {
                "bf16": _bench_cold(lambda: linear(x, wb), flush),
                "int8": _bench_cold(lambda: w8_linear(x, qi, si), flush),
                "fp8_wo": _bench_cold(lambda: w8_linear(x, qf, sf), flush),
                "fp8_w8a8": _bench_cold(lambda: F8.fp8_scaled_mm(x, qf, sf), flush),
                "scaled_mm_only": _bench_cold(lambda: torch._scaled_mm(xq, qf.t(), scale_a=sx, scale_b=sf.view(1, -1),
                                                                       out_dtype=torch.bfloat16), flush),
                "quant_only": _bench_cold(lambda: F8.quantize_rows_fp8(x), flush),
            }
            best, best_cfg = float("inf"), None
            if m >= 3:
                t["triton_default"] = _bench_cold(lambda: F8.fp8_mm(x, qf, sf), flush)
                for c in configs(m, n):
                    try:
                        y = F8.fp8_mm(x, qf, sf, config=c)
                        if (y.float() - r).abs().max().item() > tol:
                            print(f"{name} M{m} {c} WRONG", flush=True)
                            continue
                        tc = _bench_cold(lambda: F8.fp8_mm(x, qf, sf, config=c), flush)
                    except Exception as e:  # e.g. out of shared memory
                        print(f"{name} M{m} {c} {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    if tc < best:
                        best, best_cfg = tc, c
            else:
                t["triton_default"] = float("nan")
            t["triton_best"] = best if best_cfg else float("nan")
            rows.append({"shape": name, "m": m, "best_cfg": best_cfg, **{c: round(t[c] * 1000, 2) for c in COLS}})
            print(f"  best {best_cfg}", flush=True)
            print(f"{name:8s} M{m:5d} " + " ".join(f"{c} {t[c] * 1000:8.1f}" for c in COLS)
                  + f" quant {t['quant_only'] * 1000:.1f}", flush=True)
    print("\nper layer (sum of qkv, o, gate_up, down), us; ratios bf16 / fp8 path")
    print("M | " + " | ".join(COLS) + " | bf16/wo | bf16/w8a8 | bf16/triton_best")
    for m in MS:
        tot = {c: sum(r[c] for r in rows if r["m"] == m) for c in COLS}
        print(f"{m} | " + " | ".join(f"{tot[c]:.1f}" for c in COLS)
              + f" | {tot['bf16'] / tot['fp8_wo']:.2f} | {tot['bf16'] / tot['fp8_w8a8']:.2f} | "
              f"{tot['bf16'] / tot['triton_best']:.2f}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
