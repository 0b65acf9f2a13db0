"""Batch-1 decode step: which attention-side fusions shorten it? One process, graphs per variant,
replays timed round-robin (the host and the GPU clocks drift between processes more than the effects).

Usage: PYTHONPATH=. python scripts/decode_probe.py [model] [variant ...]
  variant = comma-separated switches, e.g. "rope=0,combine=0,silu=0": rope=1 rotary + K/V store inside
  the decode launch (0: the separate rotary + store launch), combine=1 the split combine fused into it
  (0: the combine kernel), silu=1 SiLU-and-mul in the gate/up GEMV's epilogue (0: its own kernel),
  splits=N decode splits for part 1 (0: choose_num_splits' count for the static bound),
  short=1 short-context decode graphs (PAGEFLASH_DECODE_SHORT_KV=4096; 0: off), argmax=1 the greedy
  argmax inside the decode graphs (PAGEFLASH_GRAPH_ARGMAX).
  KERNELS=0 skips part 1; ENGINE=0 skips part 2.

1. kernels: the attention part of a decode step at batch 1 over a short context (the latency bench's:
   128 + ~128 tokens, block tables as wide as max_model_len), rotary + store + decode (+ combine) as one
   CUDA graph per variant, us per layer.
2. the engine (dummy weights, the bench's defaults): one set of decode graphs per variant, replays of
   the batch-1 graph timed round-robin (median of rounds), logits compared with the first variant
   (max abs difference), and engine decode steps per variant.
"""

import os
import statistics
import sys
import time

import torch

from pageflash.engine.model_runner import DecodeGraphs
from pageflash.kernels.flash_decoding import choose_num_splits, flash_decode
from pageflash.kernels.rotary import apply_rotary
from probe_timing import decode_engine, round_robin  # scripts/probe_timing.py (this script's folder)

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
variants = sys.argv[2:] or ["rope=0,combine=0", "rope=1,combine=0", "rope=1,combine=1"]
dev = torch.device("cuda")


def parse(v: str) -> dict:
    sw = {"rope": "0", "combine": "0", "silu": "1", "splits": "0", "short": "1", "argmax": "1"}
    sw.update(item.split("=") for item in v.split(","))
    return {k: (int(v_) if k == "splits" else v_ == "1") for k, v_ in sw.items()}


# ---- 1. kernels ----------------------------------------------------------------------------------
hq, hkv, d, page, width = 32, 8, 128, 16, 8192 // 16
sms = torch.cuda.get_device_properties(0).multi_processor_count
splits = choose_num_splits(1, hkv, width * page, sms)
nblocks = 4096
kc = torch.randn(nblocks, page, hkv, d, device=dev, dtype=torch.bfloat16)
vc = torch.randn_like(kc)
cos = torch.rand(8192, d // 2, device=dev)
sin = torch.rand(8192, d // 2, device=dev)
counters = torch.zeros(4096, dtype=torch.int32, device=dev)
print(f"kernels: B1, Hq {hq}, Hkv {hkv}, D {d}, block table width {width} ({splits} splits)")
for L in (129, 256, 384, 1024, 4096, 8000) if os.environ.get("KERNELS", "1") != "0" else ():
    bt = torch.randperm(nblocks, device=dev)[:width].to(torch.int32).view(1, width)
    sl = torch.full((1,), L, device=dev, dtype=torch.int32)
    pos = (sl - 1).long()
    slots = (bt[0, (L - 1) // page].long() * page + (L - 1) % page).view(1)
    qkv = torch.randn(1, (hq + 2 * hkv) * d, device=dev, dtype=torch.bfloat16)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    q, k, v = q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d)
    row = {}
    for var in variants:
        sw = parse(var)
        cnt = counters if sw["combine"] else None
        ns = sw["splits"] or splits

        def step():
            if sw["rope"]:
                return flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=ns, counters=cnt,
                                    rope=(pos, cos, sin), k_new=k, v_new=v, slot_mapping=slots)
            apply_rotary(q, k, pos, cos, sin, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
            return flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=ns, counters=cnt)

        step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
            with torch.cuda.graph(g, stream=s):
                for _ in range(32):
                    step()
        torch.cuda.current_stream().wait_stream(s)
        ts = []
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(20):
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e3 / 32)
        row[var] = statistics.median(ts)
    print(f"  L {L:6d}: " + ", ".join(f"{k_} {v_:.2f} us" for k_, v_ in row.items()), flush=True)
kc = vc = None  # free the caches (the step closures above read these names)
torch.cuda.empty_cache()

# ---- 2. engine -----------------------------------------------------------------------------------
if os.environ.get("ENGINE", "1") == "0":
    sys.exit(0)
llm, eng = decode_engine(name)
r = eng.runner
be = r.backend
graphs = {}
saved = be.decode_rope, be._fused_combine
for var in variants:
    sw = parse(var)
    be.decode_rope, be._fused_combine = sw["rope"], sw["combine"]
    os.environ["PAGEFLASH_GEMV_SILU"] = "1" if sw["silu"] else "0"
    os.environ["PAGEFLASH_DECODE_SHORT_KV"] = "4096" if sw["short"] else "0"
    os.environ["PAGEFLASH_GRAPH_ARGMAX"] = "1" if sw["argmax"] else "0"
    t0 = time.perf_counter()
    g = DecodeGraphs(r, 8)
    g.capture()
    graphs[var] = g
    print(f"captured {var} in {time.perf_counter() - t0:.1f} s", flush=True)
be.decode_rope, be._fused_combine = saved

src = r.graphs
for g in graphs.values():
    for a in ("input_ids", "positions", "slots", "seq_lens", "block_tables"):
        dst = getattr(g, a)
        dst.copy_(getattr(src, a)[: dst.shape[0]])
ctx = int(src.seq_lens[0])  # the request's keys: which graph of bucket 1 the engine would take
ref = None
diff = {}
for var, g in graphs.items():
    g.select(1, ctx).graph.replay()
    torch.cuda.synchronize()
    out = g.select(1, ctx).logits[:1].float().clone()
    if ref is None:
        ref = out
    diff[var] = ((out - ref).abs().max().item(), int((out.argmax(-1) == ref.argmax(-1)).all()))

times, steps = round_robin(graphs, eng, lambda g: g.select(1, ctx).graph)

# the GPU-side floor of an engine step for the last variant: the step's input copies (pinned), the
# graph, the greedy argmax and the token's copy to the host, queued back to back (no host logic)
from pageflash.engine.sampler import argmax_rows  # noqa: E402
from pageflash.transfer import copy_to  # noqa: E402

g = graphs[variants[-1]]
host_tok = torch.empty(1, dtype=torch.int64, pin_memory=True)
names = ("input_ids", "positions", "slots", "seq_lens", "block_tables")
host_in = {a: getattr(g, a)[:1].cpu() for a in names}  # (synchronizing copies: outside the timed loop)
floor = []
for rnd in range(3):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(100):
        for a in names:
            copy_to(getattr(g, a)[:1], host_in[a])
        g.select(1, ctx).graph.replay()
        host_tok.copy_(argmax_rows(g.select(1, ctx).logits[:1]), non_blocking=True)
    torch.cuda.synchronize()
    floor.append((time.perf_counter() - t) / 100 * 1e6)
print(f"GPU-side floor of a step ({variants[-1]}: copies + graph + argmax + D2H, no host logic): "
      f"{statistics.median(floor):.1f} us")

print(f"\n{name} batch 1 decode graph, {len(times[variants[0]])} rounds")
print(f"{'variant':24s} {'replay us':>10s} {'min':>8s} {'step us':>9s} {'tok/s':>7s} {'max|dlogit|':>12s} {'argmax==':>9s}")
base = statistics.median(times[variants[0]])
for var in graphs:
    med = statistics.median(times[var])
    st = statistics.median(steps[var])
    print(f"{var:24s} {med:10.1f} {min(times[var]):8.1f} {st:9.1f} {1e6 / st:7.1f} {diff[var][0]:12.4g} "
          f"{diff[var][1]:9d}  ({med / base:.3f}x)")
