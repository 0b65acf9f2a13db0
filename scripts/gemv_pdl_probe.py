"""The batch-1 GEMV as a programmatic dependent launch (PAGEFLASH_GEMV_PDL 0 / 1 / 2), in one process.
Usage: PYTHONPATH=. python scripts/gemv_pdl_probe.py

A llama-3-8b-shaped layer chain at batch 1 -- norm, qkv GEMV, norm, gate_up GEMV with the SiLU
epilogue, down GEMV -- over 8 layers' distinct weights (every weight read from HBM), captured in a
CUDA graph per mode and replayed:
- correctness: each mode's outputs bitwise equal to mode 0's, eagerly and in the graph;
- time: µs per replay, modes alternated over rounds, and the weights' bytes over it.
"""

import os

import torch
from triton.testing import do_bench

from pageflash.kernels.gemv import gemv
from pageflash.kernels.rms_norm import rms_norm

H, I, QKV, LAYERS = 4096, 14336, 6144, 8
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
W = [dict(qkv=torch.randn(QKV, H, device=dev, dtype=torch.bfloat16, generator=g) / 64,
          gu=torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) / 64,
          down=torch.randn(H, I, device=dev, dtype=torch.bfloat16, generator=g) / 64,
          n1=torch.rand(H, device=dev, dtype=torch.bfloat16, generator=g) + 0.5,
          n2=torch.rand(H, device=dev, dtype=torch.bfloat16, generator=g) + 0.5) for _ in range(LAYERS)]
x0 = torch.randn(1, H, device=dev, dtype=torch.bfloat16, generator=g)
TILE = (8, 4, 1024, 3, 4)  # rows, r, bk, stages, warps (gate_up: 8 rows, r 4: rows % 2r == 0)
nbytes = sum(w[k].numel() * 2 for w in W for k in ("qkv", "gu", "down"))


def chain(outs):
    x = x0.clone()
    res = torch.zeros_like(x)
    for w in W:
        h, res = rms_norm(x, w["n1"], 1e-5, res)
        q = gemv(h, w["qkv"], *TILE)
        outs.append(q)
        h, res = rms_norm(q[:, :H], w["n2"], 1e-5, res)
        a = gemv(h, w["gu"], *TILE, silu_mul=True)
        x = gemv(a, w["down"], *TILE)
        outs.append(x)
    return outs


def run_mode(mode):
    os.environ["PAGEFLASH_GEMV_PDL"] = str(mode)
    eager = chain([])
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    outs = []
    with torch.cuda.stream(st):
        with torch.cuda.graph(gr, stream=st):
            chain(outs)
    torch.cuda.current_stream().wait_stream(st)
    for _ in range(3):
        gr.replay()
    torch.cuda.synchronize()
    return eager, outs, gr


modes = [0, 1, 2]
runs = {m: run_mode(m) for m in modes}
base = runs[0][0]
print("mode  eager==mode0  graph==mode0")
for m in modes:
    eq_e = all(torch.equal(a, b) for a, b in zip(runs[m][0], base))
    eq_g = all(torch.equal(a, b) for a, b in zip(runs[m][1], base))
    print(f"{m:4d}  {str(eq_e):12s}  {eq_g}")
times = {m: [] for m in modes}
for _ in range(4):
    for m in modes:
        times[m].append(do_bench(runs[m][2].replay, warmup=10, rep=100, return_mode="median") * 1e3)
print(f"chain of {LAYERS} layers ({nbytes / 1e6:.0f} MB of weights), us per replay (4 rounds):")
for m in modes:
    t = sorted(times[m])
    print(f"  PDL {m}: median {t[len(t) // 2]:8.1f}  all {' '.join(f'{v:.1f}' for v in times[m])}  "
          f"{nbytes / t[len(t) // 2] / 1e3:.0f} GB/s")
os.environ.pop("PAGEFLASH_GEMV_PDL")
