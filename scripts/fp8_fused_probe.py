"""fp8_mm with the activation quantizer fused into the kernel against a quantizer launch first, per
llama-3-8b projection and rows M (cold L2, kernels/skinny_gemm._bench_cold), inside CUDA graphs of 8
back-to-back calls (so launch gaps count as in the engine's decode graphs). Checks both give the same
result bit for bit first.
Usage: PYTHONPATH=. python scripts/fp8_fused_probe.py"""

import torch

from pageflash.kernels import fp8_linear as F8
from pageflash.kernels.skinny_gemm import _bench_cold

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def graph_of(fns):
    """One CUDA graph of the calls fns (each over its own weight, so that none is read from L2)."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    return lambda: g.replay()


def main():
    flush = torch.empty(64 << 20, dtype=torch.float16, device="cuda")
    tot = {}
    for name, (n, k) in SHAPES.items():
        ws = [F8.quantize_fp8(torch.randn(n, k, device="cuda") * 0.02) for _ in range(8)]
        q, s = ws[0]
        for m in (3, 4, 8, 16, 32, 64, 128):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            a, b = F8.fp8_mm(x, q, s, fused=False), F8.fp8_mm(x, q, s, fused=True)
            same = torch.equal(a, b)
            t_un = _bench_cold(graph_of([lambda q=q, s=s: F8.fp8_mm(x, q, s, fused=False) for q, s in ws]), flush) / 8
            t_fu = _bench_cold(graph_of([lambda q=q, s=s: F8.fp8_mm(x, q, s, fused=True) for q, s in ws]), flush) / 8
            tot.setdefault(m, [0.0, 0.0])
            tot[m][0] += t_un
            tot[m][1] += t_fu
            print(f"{name:8s} M{m:4d} unfused {t_un * 1000:7.1f} us  fused {t_fu * 1000:7.1f} us  "
                  f"{t_un / t_fu:.2f}x  same={same}", flush=True)
    print("\nper layer (4 projections), us: M | unfused | fused | unfused/fused")
    for m, (u, f) in tot.items():
        print(f"{m} | {u * 1000:.1f} | {f * 1000:.1f} | {u / f:.2f}")


if __name__ == "__main__":
    main()
