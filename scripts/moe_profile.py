"""GPU: per-kernel device time of one MoE block (router GEMM + routed_moe) at a layer shape, from
torch.profiler over eager calls.  PYTHONPATH=. python3 scripts/moe_profile.py [shape] [T ...]"""

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from pageflash.kernels import fused_moe as fm
from pageflash.layers.linear import linear

sys.path.insert(0, "scripts")
from pageflash.bench.moe import SHAPES  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-30b-a3b"
tokens = [int(a) for a in sys.argv[2:]] or [1, 64]
h, inter, e, k = SHAPES[name]
g = torch.Generator(device="cuda").manual_seed(0)
w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
gate = (torch.randn(e, h, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
for t in tokens:
    x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)

    def block():
        return fm.routed_moe(x, linear(x, gate), w13, w2, k, True)

    for _ in range(5):
        block()
    torch.cuda.synchronize()
    n = 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            block()
        torch.cuda.synchronize()
    print(f"== {name} T={t}: device µs per call, by kernel")
    rows = []
    for ev in prof.key_averages():
        dt = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if dt > 0 and ev.count >= n:
            rows.append((dt / n, ev.count // n, ev.key[:90]))
    for us, cnt, key in sorted(rows, reverse=True):
        print(f"{us:8.1f} x{cnt}  {key}")
    print(f"{sum(r[0] for r in rows):8.1f}  total")
