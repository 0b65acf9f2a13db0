"""What does an adaptive n-gram decoder cost while it stays off? Batch-64 waves of chat-like random
prompts (nothing to copy) on the dummy smollm2-135m config, plain vs ngram+adaptive vs
ngram+adaptive without probes, interleaved rounds; then one profiled round of each.
Usage: [B=64 PROMPTS=256 MAX_TOKENS=128 ROUNDS=3 MODES=plain,ngram-tree,adaptive PROFILE=0] python scripts/adaptive_overhead.py"""

import cProfile
import gc
import io
import os
import pstats
import random
import statistics
import time

import torch

from pageflash import LLM, SamplingParams
from pageflash.spec.adaptive import AdaptiveConfig, SpecController
from pageflash.spec.config import SpeculativeConfig
from pageflash.spec.decoding import SpecDecoder

B = int(os.environ.get("B", "64"))
N = int(os.environ.get("PROMPTS", "256"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "128"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(rng.randrange(30, 90))]} for _ in range(N)]
llm = LLM("smollm2-135m", load_format="dummy", max_model_len=1024, max_num_seqs=256)
eng = llm.llm_engine
sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


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
    eng.reset_prefix_cache()
    if GC_BEFORE:
        gc.collect()
    gc_t.update(t=0.0, n2=0)
    sync()
    t0 = time.perf_counter()
    toks = 0
    for w in range(0, N, B):
        ids = {eng.add_request(None, p, sp) for p in prompts[w: w + B]}
        while ids:
            for o in eng.step():
                if o.finished:
                    ids.discard(o.request_id)
                    toks += len(o.outputs[0].token_ids)
    sync()
    gc_log.setdefault(name, []).append((round(gc_t["t"] * 1e3), gc_t["n2"]))
    return toks / (time.perf_counter() - t0)


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
