"""How fast can a batch-1 projection stream its weight? Usage: PYTHONPATH=. python scripts/gemv_probe.py

For each llama-3-8b projection shape, a CUDA graph of 32 calls over 8 distinct weights (so every
call reads HBM, as in a decode step) is replayed and timed:
- read: a pure streaming read of the same bytes (Triton, contiguous chunk per program, summed) --
  the ceiling any GEMV can reach;
- cuBLAS: F.linear;
- skinny: the engine's skinny kernel, its configs;
- gemv: kernels/gemv.py over several (rows per program, tile r x bk, stages, warps).
Prints us per call and GB/s.
"""

import os

import torch
import triton

from graph_timing import graph_time, read_kernel  # (scripts/, the running script's folder)
from pageflash.kernels import skinny_gemm as sg
from pageflash.kernels.gemv import gemv


shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
dev = "cuda"
NW = 8
sink = torch.empty(1 << 20, device=dev)


# GEMV_TILES="r,bk,stages,warps;..." and GEMV_PROGS="384,512,768" widen the sweep (session 14, H200);
# READ=0 skips the pure-read ceiling, SHAPES="qkv o" picks projections
TILES = [tuple(int(v) for v in t.split(",")) for t in os.environ.get(
    "GEMV_TILES", "2,1024,4,4;4,512,4,4;4,1024,3,8;2,2048,3,8").split(";")]
PROGS = [int(v) for v in os.environ.get("GEMV_PROGS", "384,512,768").split(",")]
TOP = int(os.environ.get("TOP", "8"))


def gemv_cfgs_for(N):
    out = []
    for r, bk, st, wp in TILES:
        for progs in PROGS:
            rows = max(r, -(-(-(-N // progs)) // r) * r)  # cdiv(N, progs) rounded up to a multiple of r
            out.append((rows, r, bk, st, wp))
    return out


print(f"{'shape':8s} {'what':34s} {'us/call':>8s} {'GB/s':>6s}")
for name, (N, K) in shapes.items():
    if os.environ.get("SHAPES") and name not in os.environ["SHAPES"].split():
        continue
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) / 64 for _ in range(NW)]
    x = torch.randn(1, K, device=dev, dtype=torch.bfloat16)
    y = torch.empty(N, device=dev, dtype=torch.bfloat16)
    nbytes = N * K * 2
    res = []
    ref = torch.nn.functional.linear(x, ws[0]).float()
    for block, stages, warps in ((4096, 3, 8), (8192, 3, 8), (4096, 4, 4), (2048, 4, 4)) if os.environ.get("READ") != "0" else ():
        for waves in (1, 2, 4):
            progs = 132 * waves
            per = triton.cdiv(N * K, progs * block)
            grid = triton.cdiv(N * K, block * per)
            t = graph_time(lambda i: read_kernel[(grid,)](ws[i % NW], N * K, sink, BLOCK=block, PER=per,
                                                          STAGES=stages, num_warps=warps))
            res.append((t, f"read B{block} s{stages} w{warps} x{waves}"))
    res.sort()
    for t, what in res[:2]:
        print(f"{name:8s} {what:34s} {t:8.2f} {nbytes / t / 1e3:6.0f}")
    t = graph_time(lambda i: torch.nn.functional.linear(x, ws[i % NW]))
    print(f"{name:8s} {'cuBLAS':34s} {t:8.2f} {nbytes / t / 1e3:6.0f}")
    for c in sg._CONFIGS:
        t = graph_time(lambda i: sg.skinny_gemm(x, ws[i % NW], *c))
        print(f"{name:8s} {'skinny ' + str(c):34s} {t:8.2f} {nbytes / t / 1e3:6.0f}")
    res = []
    for c in gemv_cfgs_for(N):
        try:
            gemv(x, ws[0], *c, out=y[None])
            err = (y.float() - ref[0]).abs().max().item()
            t = graph_time(lambda i: gemv(x, ws[i % NW], *c, out=y[None]))
            res.append((t, f"gemv {c} err {err:.1e}"))
        except Exception as ex:  # noqa: BLE001
            print(f"{name:8s} gemv {c} failed: {type(ex).__name__}: {str(ex)[:80]}")
    res.sort()
    for t, what in res[:TOP]:
        print(f"{name:8s} {what:34s} {t:8.2f} {nbytes / t / 1e3:6.0f}")
    ws.clear()
    torch.cuda.empty_cache()
