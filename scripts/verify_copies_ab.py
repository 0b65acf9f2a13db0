"""Packed verify-step input copies (2 + mask) against one copy per input (7), in one process:
batch-1 n-gram speculation (k = 5) on a repetitive prompt with the dummy smollm2-135m, the mode
toggled every round (StepGraphs.packed_copies), host time of StepGraphs.run and tok/s per round.
Usage: [ROUNDS=8 MAX_TOKENS=256] python scripts/verify_copies_ab.py"""

import os
import statistics
import time

import torch

from pageflash import LLM, SamplingParams

ROUNDS = int(os.environ.get("ROUNDS", "8"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "256"))
prompt = {"prompt_token_ids": [(i * 7919) % 20000 + 1000 for i in range(64)] * 8}
llm = LLM("smollm2-135m", load_format="dummy", max_model_len=2048, num_kv_blocks=4096,
          speculative_config={"method": "ngram", "num_speculative_tokens": 5})
eng = llm.llm_engine
sg = eng.runner.step_graphs
sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
run_t = {"t": 0.0, "n": 0}
orig = sg.run


def timed(*a, **k):
    t = time.perf_counter()
    try:
        return orig(*a, **k)
    finally:
        run_t["t"] += time.perf_counter() - t
        run_t["n"] += 1


sg.run = timed
res = {True: [], False: []}
for i in range(2 * ROUNDS + 2):
    packed = i % 2 == 0
    sg.packed_copies = packed
    llm.reset_prefix_cache()
    run_t.update(t=0.0, n=0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate([prompt], sp, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if i >= 2:  # the first pair warms up
        res[packed].append((MAX_TOKENS / dt, run_t["t"] / max(run_t["n"], 1) * 1e6))
print("| mode | tok/s per round | median tok/s | StepGraphs.run us/call (median) |")
for packed, rows in res.items():
    print(f"| {'packed (2 copies + mask)' if packed else 'one copy per input'} | "
          f"{', '.join(f'{x:.0f}' for x, _ in rows)} | {statistics.median(x for x, _ in rows):.0f} | "
          f"{statistics.median(u for _, u in rows):.0f} |")
pairs = [a[0] / b[0] for a, b in zip(res[True], res[False])]
print(f"paired ratio packed / each: median {statistics.median(pairs):.3f} ({', '.join(f'{p:.2f}' for p in pairs)})")
