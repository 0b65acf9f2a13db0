"""Where does a batch-1 decode step go? Graph replay alone vs the whole engine step, and the
eager forward's kernels by GPU time. Usage: python scripts/profile_decode.py [model] [batch]"""

import sys
import time

import torch

from pageflash import LLM, SamplingParams

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
llm = LLM(name, load_format="dummy", max_model_len=2048, gpu_memory_utilization=0.85)
eng = llm.llm_engine
for i in range(batch):
    eng.add_request(None, {"prompt_token_ids": list(range(10 + i, 138 + i))},
                    SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
for _ in range(5):
    eng.step()
torch.cuda.synchronize()
n = 50
t = time.perf_counter()
for _ in range(n):
    eng.step()
step_ms = (time.perf_counter() - t) / n * 1e3
g = eng.runner.graphs
bucket = next(x for x in g.buckets if x >= batch)
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(n):
    g.graphs[bucket].replay()
e.record()
torch.cuda.synchronize()
replay_ms = s.elapsed_time(e) / n
# host-side parts of a step
sched = eng.scheduler.schedule()
t = time.perf_counter()
for _ in range(n):
    bts = [eng.kv.block_ids(x.request.request_id) for x in sched.seqs]
    res = g.run(sched, bts)
torch.cuda.synchronize()
run_ms = (time.perf_counter() - t) / n * 1e3
# undo the schedule's effect is not needed: the engine is discarded after this
print(f"{name} batch {batch}: engine step {step_ms:.3f} ms | graph replay {replay_ms:.3f} ms | "
      f"graphs.run (inputs + replay) {run_ms:.3f} ms")
from torch.profiler import ProfilerActivity, profile

runner = eng.runner
ids = torch.zeros(batch, dtype=torch.int64, device="cuda")
meta = g._meta(bucket)
plan = runner.backend.plan(meta)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        with torch.inference_mode():
            runner.model.compute_logits(runner.model(g.input_ids[:bucket], g.positions[:bucket], runner.kv_caches, runner.backend, plan))
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
from pageflash.kernels import skinny_gemm

print("skinny GEMM choices (N, K, M, dtype) -> config or None (cuBLAS):",
      None if skinny_gemm._DISPATCH is None else skinny_gemm._DISPATCH.choice)
