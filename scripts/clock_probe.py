"""Where does the round-to-round spread of host-bound batch-64 decoding come from: the host CPU or
the GPU's clocks? Runs plain waves of the dummy smollm2-135m (ROUNDS rounds of PROMPTS prompts in
waves of B, MAX_TOKENS new tokens) and, per round: tok/s, the time of a fixed pure-Python loop run
right after it (host speed), the GPU time of one decode step (CUDA events around a graph-sized
step, GPU speed), and the SM clock nvidia-smi sampled every 50 ms during the round.
Usage: [B=64 PROMPTS=256 MAX_TOKENS=128 ROUNDS=12] python scripts/clock_probe.py"""

import os
import random
import statistics
import subprocess
import threading
import time

import torch

from pageflash import LLM, SamplingParams

B = int(os.environ.get("B", "64"))
N = int(os.environ.get("PROMPTS", "256"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "128"))
ROUNDS = int(os.environ.get("ROUNDS", "12"))

rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(rng.randrange(30, 90))]} for _ in range(N)]
llm = LLM("smollm2-135m", load_format="dummy", max_model_len=1024, max_num_seqs=256)
eng = llm.llm_engine
sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

clocks: list[tuple[float, int]] = []
stop = threading.Event()


def sample() -> None:
    p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-lms", "50"],
                         stdout=subprocess.PIPE, text=True)
    while not stop.is_set():
        line = p.stdout.readline()
        if not line:
            break
        try:
            clocks.append((time.perf_counter(), int(line.strip())))
        except ValueError:
            pass
    p.kill()


def cpu_loop() -> float:
    t = time.perf_counter()
    x = 0
    for i in range(2_000_000):
        x += i & 7
    return time.perf_counter() - t


def round_() -> tuple[float, float, float]:
    eng.reset_prefix_cache()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    toks = 0
    for w in range(0, N, B):
        ids = {eng.add_request(None, p, sp) for p in prompts[w: w + B]}
        while ids:
            for o in eng.step():
                if o.finished:
                    ids.discard(o.request_id)
                    toks += len(o.outputs[0].token_ids)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    return toks / (t1 - t0), t0, t1


th = threading.Thread(target=sample, daemon=True)
th.start()
round_()  # warm-up
rows = []
for _ in range(ROUNDS):
    tps, t0, t1 = round_()
    c = [v for t, v in clocks if t0 <= t <= t1]
    rows.append((tps, cpu_loop() * 1e3, statistics.mean(c) if c else float("nan"), min(c) if c else 0))
stop.set()
print("| round | tok/s | pure-Python loop ms | SM MHz mean | SM MHz min |")
for i, (tps, ms, mhz, lo) in enumerate(rows):
    print(f"| {i} | {tps:.0f} | {ms:.1f} | {mhz:.0f} | {lo} |")
