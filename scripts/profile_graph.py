"""What the GPU does inside a batch-1 decode step's CUDA graph, kernel by kernel, and how fast the
GEMMs alone could go. Usage: PYTHONPATH=. python scripts/profile_graph.py [model] [batch]

1. engine steps (dummy weights, 128-token prompt) under torch.profiler: kernels launched by graph
   replays are recorded one by one; grouped by kernel name, per step (GPU µs, count).
2. the step's period without the profiler, and the graph replay alone.
3. each projection shape at M = batch: cuBLAS vs the skinny kernel's configs (µs, GB/s), and a CUDA
   graph of only the step's GEMMs (all layers) -- the floor the rest of the step sits on.
"""

import sys
import time
from collections import defaultdict

import torch
from triton.testing import do_bench

from pageflash import LLM, SamplingParams
from pageflash.kernels import skinny_gemm as sg

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
import os

# BENCH=1: the engine exactly as `pageflash bench latency` builds it (defaults)
kw = {} if os.environ.get("BENCH") == "1" else {"max_model_len": 2048, "gpu_memory_utilization": 0.85}
llm = LLM(name, load_format="dummy", **kw)
eng = llm.llm_engine
for i in range(batch):
    eng.add_request(None, {"prompt_token_ids": list(range(10 + i, 138 + i))},
                    SamplingParams(temperature=0, max_tokens=int(os.environ.get("MAXTOK", 1000)), ignore_eos=True))
for _ in range(10):
    eng.step()
torch.cuda.synchronize()
n = 100
t = time.perf_counter()
for _ in range(n):
    eng.step()
torch.cuda.synchronize()
step_ms = (time.perf_counter() - t) / n * 1e3
g = eng.runner.graphs
bucket = next(x for x in g.buckets if x >= batch)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(n):
    g.full[bucket].graph.replay()
e.record()
torch.cuda.synchronize()
replay_ms = s.elapsed_time(e) / n

from torch.profiler import ProfilerActivity, profile

steps = 20
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
agg = defaultdict(lambda: [0.0, 0])
for ev in prof.events():
    if ev.device_type == torch.autograd.DeviceType.CUDA:
        a = agg[ev.name[:70]]
        a[0] += ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
        a[1] += 1
total = sum(v[0] for v in agg.values()) / steps
print(f"\n{name} batch {batch}: step {step_ms:.3f} ms | graph replay {replay_ms:.3f} ms | "
      f"sum of kernel times {total / 1e3:.3f} ms per step (the rest of the replay: gaps between kernels)")
print(f"{'kernel':70s} {'us/step':>9s} {'n/step':>7s} {'us each':>8s}")
for k, (tt, c) in sorted(agg.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"{k:70s} {tt / steps:9.1f} {c / steps:7.1f} {tt / c:8.2f}")

# GEMM shapes of the model at M = batch
cfg = eng.runner.cfg
H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, H), "o": (cfg.q_size, cfg.q_size), "gate_up": (2 * I, H),
          "down": (H, I), "lm_head": (V, H)}
shapes["o"] = (H, cfg.q_size)
x = {k: torch.randn(batch, K, device="cuda", dtype=torch.bfloat16) for k, (N, K) in shapes.items()}
w = {k: torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / 64 for k, (N, K) in shapes.items()}
configs = [(16, 256, 1, 4, 4), (16, 512, 1, 4, 3), (32, 256, 1, 4, 4), (32, 128, 1, 4, 4), (64, 128, 1, 4, 4),
           (64, 256, 1, 8, 3), (16, 256, 2, 4, 4), (8, 512, 1, 4, 4), (16, 1024, 1, 8, 2)]
print(f"\n{'shape':8s} {'N x K':>14s} {'cuBLAS us':>10s} {'GB/s':>6s}  best skinny (cfg: us, GB/s)")
for k, (N, K) in shapes.items():
    nbytes = N * K * 2
    tb = do_bench(lambda: torch.nn.functional.linear(x[k], w[k]), warmup=10, rep=50, return_mode="median")
    res = []
    for c in configs:
        try:
            ts = do_bench(lambda: sg.skinny_gemm(x[k], w[k], *c), warmup=10, rep=50, return_mode="median")
            res.append((ts, c))
        except Exception as ex:  # noqa: BLE001
            print("  config", c, "failed:", type(ex).__name__)
    res.sort()
    best = ", ".join(f"{c[:2]}/sk{c[2]}/w{c[3]}s{c[4]}: {ts * 1e3:.1f} us {nbytes / ts / 1e6:.0f}" for ts, c in res[:3])
    print(f"{k:8s} {N:>6d} x {K:<6d} {tb * 1e3:10.1f} {nbytes / tb / 1e6:6.0f}  {best}")

# a graph of only the step's GEMMs, as the engine dispatches them
L = cfg.num_hidden_layers
xs = {k: x[k].clone() for k in x}
layer_ws = {k: [torch.randn_like(w[k]) for _ in range(min(L, 8))] for k in ("qkv", "o", "gate_up", "down")}


def gemms(use_skinny: bool):
    for i in range(L):
        for k in ("qkv", "o", "gate_up", "down"):
            wi = layer_ws[k][i % len(layer_ws[k])]
            y = sg.maybe_skinny_linear(xs[k], wi) if use_skinny else None
            if y is None:
                torch.nn.functional.linear(xs[k], wi)
    torch.nn.functional.linear(xs["lm_head"], w["lm_head"])


for use in (False, True):
    gemms(use)
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        with torch.cuda.graph(gr, stream=st):
            gemms(use)
    torch.cuda.synchronize()
    ms = do_bench(gr.replay, warmup=5, rep=50, return_mode="median")
    nbytes = L * sum(shapes[k][0] * shapes[k][1] * 2 for k in ("qkv", "o", "gate_up", "down")) + V * H * 2
    print(f"GEMMs only graph ({'dispatch' if use else 'cuBLAS'}): {ms:.3f} ms, {nbytes / ms / 1e6:.0f} GB/s "
          f"(8 distinct weight sets per shape cycled, L2 50 MB: weights are read from HBM)")
print("skinny choices:", None if sg._DISPATCH is None else sg._DISPATCH.choice)
src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
dst = torch.empty_like(src)
ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=30, return_mode="median")
print(f"copy bandwidth (read + write): {2 * src.numel() * 2 / ms / 1e6:.0f} GB/s")
