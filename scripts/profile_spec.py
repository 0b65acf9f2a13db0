"""Why is a speculative step slow on the GPU? Step time with and without n-gram speculation on the
dummy smollm2-135m config (BATCH sequences, default 1), the GPU-synced time of runner.execute inside
it, and the host functions that take the rest (cProfile). Usage: [BATCH=64] python scripts/profile_spec.py"""

import cProfile
import io
import pstats
import random
import time

import os

import torch

from pageflash import LLM, SamplingParams

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "200"))

rng = random.Random(0)
BATCH = int(os.environ.get("BATCH", "1"))
# repetitive: n-gram lookup always finds a continuation
prompts = [{"prompt_token_ids": [rng.randrange(1000, 9000) for _ in range(64)] * 8} for _ in range(BATCH)]


def run(spec):
    llm = LLM("smollm2-135m", load_format="dummy", max_model_len=2048, num_kv_blocks=2048 * BATCH,
              speculative_config=spec)
    eng = llm.llm_engine
    runner = eng.runner
    ex = {"t": 0.0, "n": 0}
    orig = runner.execute

    def timed(*a, **k):
        sync()
        t = time.perf_counter()
        r = orig(*a, **k)
        sync()
        ex["t"] += time.perf_counter() - t
        ex["n"] += 1
        return r

    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(3):  # warm-up: compiles, graph captures (every run starts from an empty prefix cache)
        llm.reset_prefix_cache()
        llm.generate(prompts, sp, use_tqdm=False)
    llm.reset_prefix_cache()
    t = time.perf_counter()
    out = llm.generate(prompts, sp, use_tqdm=False)  # clean timing: no profiler, no added syncs
    clean = sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t)
    llm.reset_prefix_cache()
    runner.execute = timed
    ex.update(t=0.0, n=0)
    pr = cProfile.Profile()
    t = time.perf_counter()
    pr.enable()
    out = llm.generate(prompts, sp, use_tqdm=False)
    pr.disable()
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in out)
    print(f"spec={spec}: {clean:.1f} tok/s clean; profiled {n / wall:.1f} tok/s, {ex['n']} steps, {wall / ex['n'] * 1e3:.2f} ms/step, "
          f"execute {ex['t'] / ex['n'] * 1e3:.2f} ms/step, accepted/step {eng.get_stats().get('spec')}")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats(os.environ.get("SORT", "cumtime")).print_stats(int(os.environ.get("ROWS", "22")))
    print(s.getvalue()[-9000:])


run(None)
run({"method": "ngram", "num_speculative_tokens": 5})
if os.environ.get("TREE"):
    run({"method": "ngram", "num_speculative_tokens": 15, "tree": [3]})
