"""Where does W-offline time go? Steps by kind (graph decode / eager mixed / prefill-only), GPU-synced
time of runner.execute, and host time outside it. Usage: python scripts/profile_offline.py [model] [num_prompts]"""

import collections
import sys
import time

import torch

from pageflash import LLM, SamplingParams
from pageflash.bench.throughput import w_offline_requests

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
num = int(sys.argv[2]) if len(sys.argv) > 2 else 256
llm = LLM(name, load_format="dummy")
eng = llm.llm_engine
runner = eng.runner
stats = collections.defaultdict(lambda: [0, 0.0, 0])  # kind -> [steps, seconds, tokens]
orig = runner.execute


def timed(sched, *a, **k):
    torch.cuda.synchronize()
    t = time.perf_counter()
    r = orig(sched, *a, **k)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    ntok = sched.num_tokens
    nseq = len(sched.seqs)
    if ntok == nseq:
        kind = "decode(graph)" if runner.graphs is not None and nseq <= runner.graphs.max_batch else "decode(eager)"
    elif all(s.request.num_computed_tokens == 0 for s in sched.seqs):
        kind = "prefill-only"
    else:
        kind = "mixed"
    s = stats[kind]
    s[0] += 1
    s[1] += dt
    s[2] += ntok
    return r


runner.execute = timed
reqs = w_offline_requests(num)
t = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                    SamplingParams(temperature=0, max_tokens=512, ignore_eos=True), use_tqdm=False)
wall = time.perf_counter() - t
ntok = sum(len(o.outputs[0].token_ids) for o in outs)
gpu = sum(s[1] for s in stats.values())
print(f"{name}: {num} prompts, wall {wall:.2f} s, {ntok / wall:.0f} out tok/s, execute {gpu:.2f} s, "
      f"host (schedule+sample+process) {wall - gpu:.2f} s, preemptions {eng.scheduler.num_preemptions}, "
      f"blocks {eng.kv.pool.num_blocks}")
for kind, (n, sec, tok) in sorted(stats.items()):
    print(f"  {kind:14s} steps {n:5d}  {sec:7.2f} s  {sec / n * 1e3:7.2f} ms/step  tokens {tok:8d}  {tok / sec:9.0f} tok/s")
