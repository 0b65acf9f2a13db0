"""Host time by phase of W-offline steps, without any added synchronization (so async scheduling's
overlap is kept): schedule, execute (launch), sampling launch, waiting for the tokens, processing,
outputs. Usage: python scripts/profile_async.py [model] [num_prompts] [on|off ...]"""

import collections
import sys
import time

import torch

import pageflash.engine.engine as E
from pageflash import LLM, SamplingParams
from pageflash.bench.throughput import w_offline_requests

name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
num = int(sys.argv[2]) if len(sys.argv) > 2 else 256
modes = sys.argv[3:] or ["on", "off"]
acc = collections.defaultdict(float)


def wrap(obj, attr, key):
    orig = getattr(obj, attr)

    def f(*a, **k):
        t = time.perf_counter()
        try:
            return orig(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t
    setattr(obj, attr, f)


wrap(E._Inflight, "fetch", "wait+tolist")
wrap(E._Inflight, "__init__", "d2h launch")
rows = []
for mode in modes:
    llm = LLM(name, load_format="dummy", async_scheduling=(mode == "on"))
    eng = llm.llm_engine
    wrap(eng.scheduler, "schedule", "schedule")
    wrap(eng.runner, "execute", "execute")
    wrap(eng, "_launch", "launch (sample)")
    wrap(eng, "_resolve", "resolve")
    wrap(eng, "_outputs", "outputs")
    wrap(eng, "step", "step")
    reqs = w_offline_requests(num)
    sp = SamplingParams(temperature=0, max_tokens=512, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p, _ in reqs[:16]], sp, use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    acc.clear()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], sp, use_tqdm=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    ntok = sum(len(o.outputs[0].token_ids) for o in outs)
    rows.append((mode, wall, ntok / wall, dict(acc)))
    del llm, eng
    torch.cuda.empty_cache()
for mode, wall, tps, a in rows:
    print(f"{name} async={mode}: wall {wall:.2f} s, {tps:.0f} out tok/s")
    for k, v in sorted(a.items(), key=lambda kv: -kv[1]):
        print(f"   {k:16s} {v:7.3f} s")
