"""Why do plain batch-64 rounds of a small model spread so much? Runs the same plain workload several
times (waves of BATCH requests, prompts of ~LEN tokens, MAX_TOKENS new tokens, ignore_eos) and prints
tok/s per round with the time Python's cyclic GC spent inside it, first as is, then after
gc.freeze() (objects alive after warm-up are no longer scanned).
Usage: [BATCH=64 LEN=1000 MAX_TOKENS=128 ROUNDS=4 PROMPTS=256] python scripts/noise_probe.py [model]"""

import gc
import os
import random
import sys
import time

import torch

from pageflash import LLM, SamplingParams

MODEL = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
BATCH = int(os.environ.get("BATCH", "64"))
LEN = int(os.environ.get("LEN", "1000"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "128"))
ROUNDS = int(os.environ.get("ROUNDS", "4"))
PROMPTS = int(os.environ.get("PROMPTS", "256"))

rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(rng.randrange(LEN - 100, LEN + 100))]}
           for _ in range(PROMPTS)]
gc_t = {"t": 0.0, "n": [0, 0, 0], "start": 0.0}


def on_gc(phase, info):
    if phase == "start":
        gc_t["start"] = time.perf_counter()
    else:
        gc_t["t"] += time.perf_counter() - gc_t["start"]
        gc_t["n"][info["generation"]] += 1


gc.callbacks.append(on_gc)
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
llm = LLM(MODEL, load_format="dummy", max_model_len=LEN + 256 + MAX_TOKENS, max_num_seqs=256)
eng = llm.llm_engine
sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run_round():
    eng.reset_prefix_cache()
    sync()
    gc_t.update(t=0.0, n=[0, 0, 0])
    t0 = time.perf_counter()
    steps = 0
    toks = 0
    for w in range(0, len(prompts), BATCH):
        ids = [eng.add_request(None, p, sp) for p in prompts[w: w + BATCH]]
        left = set(ids)
        while left:
            for o in eng.step():
                if o.finished:
                    left.discard(o.request_id)
                    toks += len(o.outputs[0].token_ids)
            steps += 1
    sync()
    s = time.perf_counter() - t0
    return toks / s, s, steps, gc_t["t"], list(gc_t["n"])


for _ in range(1):  # warm-up
    run_round()
rows = []
for mode in ("as is", "gc.freeze"):
    if mode == "gc.freeze":
        gc.collect()
        gc.freeze()
    for r in range(ROUNDS):
        tps, s, steps, gcs, gcn = run_round()
        rows.append((mode, r, tps, s, steps, gcs, gcn))
        print(f"{mode:10s} round {r}: {tps:9.0f} tok/s  {s:6.2f} s  {steps} steps  "
              f"gc {gcs * 1e3:7.1f} ms  collections per gen {gcn}", flush=True)
print(f"objects tracked by gc after the runs: {len(gc.get_objects())}, frozen {gc.get_freeze_count()}")
