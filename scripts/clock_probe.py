"""Where does the round-to-round spread of host-bound batch-64 decoding come from: the host CPU or
the GPU's clocks? Runs plain waves of the dummy smollm2-135m (ROUNDS rounds of PROMPTS prompts in
waves of B, MAX_TOKENS new tokens) and, per round: tok/s, the time of a fixed pure-Python loop run
right after it (host speed), the GPU time of one decode step (CUDA events around a graph-sized
step, GPU speed), and the SM clock nvidia-smi sampled every 50 ms during the round.
Usage: [B=64 PROMPTS=256 MAX_TOKENS=128 ROUNDS=12] python scripts/clock_probe.py"""

import os
import statistics
import subprocess
import threading
import time


from probe_timing import chat_waves  # scripts/probe_timing.py (this script's folder)
from pageflash.bench.spec import run_waves

ROUNDS = int(os.environ.get("ROUNDS", "12"))
eng, prompts, sp, B = chat_waves()

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
    t0 = time.perf_counter()
    outs, secs = run_waves(eng, prompts, sp, B)
    return sum(len(o.outputs[0].token_ids) for o in outs) / secs, t0, time.perf_counter()


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
