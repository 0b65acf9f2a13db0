"""Does prefetching weights into L2 on a side stream shorten a batch-1 decode step?

Usage: PYTHONPATH=. python scripts/prefetch_probe.py [model] [variant ...]
  variant = "off" or "MODE:kind=MiB,kind=MiB" (MODE bulk/line/load; kinds qkv/o/gate_up/down/lm_head),
  optionally followed by "|N=ROWS,..." to force the GEMV with ROWS rows per program on the batch-1
  projections of output size N while that variant's graphs are captured

1. isolated: a GEMV of the o-projection shape after an L2 flush, cold vs after a prefetch of its
   weight (each mode) and a pause long enough for the prefetch to land.
2. the engine (dummy weights, the bench's defaults): one set of decode graphs per variant, replays of
   the batch-1 graph timed round-robin (median of rounds), logits compared with "off" bitwise, and
   engine decode steps per variant.
"""

import os
import statistics
import sys
import time

import torch

from pageflash.engine.model_runner import DecodeGraphs
from pageflash.kernels.prefetch import l2_prefetch
from pageflash.layers.linear import linear
from probe_timing import decode_engine, round_robin  # scripts/probe_timing.py (this script's folder)

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
variants = sys.argv[2:] or ["off", "bulk:o=16", "bulk:o=24", "bulk:o=32", "bulk:o=24,qkv=8",
                            "bulk:o=24,qkv=8,gate_up=8,down=8", "line:o=24,qkv=8", "load:o=24,qkv=8"]
dev = torch.device("cuda")

# ---- 1. isolated ---------------------------------------------------------------------------------
flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16) / 64
x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
linear(x, w)
torch.cuda.synchronize()


def timed(pre_mode):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(30):
        flush.add_(1)
        if pre_mode:
            l2_prefetch(w, 32 << 20, pre_mode)
            torch.cuda._sleep(40_000)  # ~20 us at 1.98 GHz
        else:
            torch.cuda._sleep(40_000)
        s.record()
        linear(x, w)
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return statistics.median(ts)


print("isolated o-proj GEMV (4096x4096 bf16, 32 MiB) after an L2 flush, us:")
iso = {m: timed(m) for m in (None, "bulk", "line", "load")}
for m, t in iso.items():
    print(f"  {m or 'cold':6s} {t:7.2f}")

# prefetch kernels alone (launch + issue), us; the first call compiles
for m in ("bulk", "line", "load"):
    l2_prefetch(w, 24 << 20, m)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush.add_(1)
    s.record()
    l2_prefetch(w, 24 << 20, m)
    e.record()
    torch.cuda.synchronize()
    print(f"  prefetch kernel {m}: {s.elapsed_time(e) * 1e3:.2f} us")

# ---- 2. engine -----------------------------------------------------------------------------------
llm, eng = decode_engine(name)
r = eng.runner
max_batch = r.graphs.max_batch
graphs = {}
from pageflash.kernels import skinny_gemm as sg

for v in variants:
    saved = dict(sg._DISPATCH.choice)
    v_pf, _, force = v.partition("|")
    for item in filter(None, force.split(",")):
        n_out, rows = map(int, item.split("="))
        for key in list(sg._DISPATCH.choice):
            if key[0] == n_out and key[2] == 1:
                sg._DISPATCH.choice[key] = ("gemv", (rows, 4, 512, 4, 4))
    if v_pf == "off":
        os.environ["PAGEFLASH_L2_PREFETCH"] = "0"
    else:
        mode, spec = v_pf.split(":", 1)
        os.environ["PAGEFLASH_L2_PREFETCH"] = spec
        os.environ["PAGEFLASH_L2_PREFETCH_MODE"] = mode
    t0 = time.perf_counter()
    g = DecodeGraphs(r, 8)
    g.capture()
    graphs[v] = g
    sg._DISPATCH.choice.clear()
    sg._DISPATCH.choice.update(saved)
    print(f"captured {v} in {time.perf_counter() - t0:.1f} s", flush=True)

# same inputs in every variant's buffers: copy the engine's current static inputs
src = r.graphs
for g in graphs.values():
    for a in ("input_ids", "positions", "slots", "seq_lens", "block_tables"):
        d = getattr(g, a)
        d.copy_(getattr(src, a)[: d.shape[0]])
ref = None
same = {}
for v, g in graphs.items():
    g.full[1].graph.replay()
    torch.cuda.synchronize()
    out = g.full[1].logits.clone()
    if ref is None:
        ref = out
    same[v] = bool(torch.equal(out, ref))

times, steps = round_robin(graphs, eng, lambda g: g.full[1].graph)

print(f"\n{name} batch 1 decode graph, {len(times[variants[0]])} rounds")
print(f"{'variant':40s} {'replay us':>10s} {'min':>8s} {'step us':>9s} {'tok/s':>7s} {'logits == off':>14s}")
base = statistics.median(times[variants[0]])
for v in graphs:
    med = statistics.median(times[v])
    st = statistics.median(steps[v])
    print(f"{v:40s} {med:10.1f} {min(times[v]):8.1f} {st:9.1f} {1e6 / st:7.1f} {str(same[v]):>14s}  ({med / base:.3f}x)")
