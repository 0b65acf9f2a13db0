"""What does an adaptive n-gram decoder cost while it stays off? Batch-64 waves of chat-like random
prompts (nothing to copy) on the dummy smollm2-135m config, plain vs ngram+adaptive vs
ngram+adaptive without probes, interleaved rounds; then one profiled round of each.
Usage: [B=64 PROMPTS=256 MAX_TOKENS=128 ROUNDS=3 MODES=plain,ngram-tree,adaptive PROFILE=0] python scripts/adaptive_overhead.py"""

import cProfile
import gc
import io
import os
import pstats
import statistics
import time


from probe_timing import chat_waves  # scripts/probe_timing.py (this script's folder)
from pageflash.bench.spec import run_waves
from pageflash.spec.adaptive import AdaptiveConfig, SpecController
from pageflash.spec.config import SpeculativeConfig
from pageflash.spec.decoding import SpecDecoder

ROUNDS = int(os.environ.get("ROUNDS", "3"))
eng, prompts, sp, B = chat_waves()


def decoder(probes: bool, adaptive: bool = True, tree=None) -> SpecDecoder:
    cfg = {"method": "ngram", "num_speculative_tokens": 5, "adaptive": adaptive}
    if tree:
        cfg.update(tree=tree, num_speculative_tokens=15)
    d = SpecDecoder(eng, SpeculativeConfig.parse(cfg))
    if adaptive and not probes:
        d.ctrl = SpecController(AdaptiveConfig(k_max=5, probe_k=2, probe_interval=10**9))
    d.bind(eng.kv.pool.num_blocks)
    return d


ALL = {"plain": lambda: None, "adaptive": lambda: decoder(True), "adaptive, no probes": lambda: decoder(False),
       "ngram-tree": lambda: decoder(True, adaptive=False, tree=[3])}
modes = {m: ALL[m]() for m in os.environ.get("MODES", "plain,adaptive,adaptive, no probes").split(",")}


GC_BEFORE = os.environ.get("GC_BEFORE") == "1"
gc_t = {"t": 0.0, "t0": 0.0, "n2": 0}


def on_gc(phase, info):
    if phase == "start":
        gc_t["t0"] = time.perf_counter()
    else:
        gc_t["t"] += time.perf_counter() - gc_t["t0"]
        gc_t["n2"] += info["generation"] == 2


gc.callbacks.append(on_gc)
gc_log = {}


def run(d, name: str) -> float:
    eng.spec = d
    if GC_BEFORE:
        gc.collect()
    gc_t.update(t=0.0, n2=0)
    outs, secs = run_waves(eng, prompts, sp, B)
    gc_log.setdefault(name, []).append((round(gc_t["t"] * 1e3), gc_t["n2"]))
    return sum(len(o.outputs[0].token_ids) for o in outs) / secs


for m, d in modes.items():  # warm-up
    run(d, m)
res = {m: [] for m in modes}
for _ in range(ROUNDS):
    for m, d in modes.items():
        res[m].append(run(d, m))
for m, d in modes.items() if os.environ.get("PROFILE", "1") == "1" else ():
    pr = cProfile.Profile()
    pr.enable()
    run(d, m)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
    print(f"==== {m} (profiled round)\n" + s.getvalue()[-5000:])
    if d is not None and d.ctrl is not None:
        print(m, "verify steps", d.metrics.as_dict(), d.ctrl.as_dict())
print("gc ms and gen-2 collections per run, by decoder:", gc_log)
base = statistics.median(res["plain"])
print("\n| mode | tok/s rounds | median | vs plain | paired (median of round ratios) |")
for m, r in res.items():
    paired = statistics.median(x / y for x, y in zip(r, res["plain"]))
    print(f"| {m} | {', '.join(f'{x:.0f}' for x in r)} | {statistics.median(r):.0f} | {statistics.median(r) / base:.3f} "
          f"| {paired:.3f} |")
