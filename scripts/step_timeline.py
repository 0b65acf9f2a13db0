"""Where a batch-1 decode step's time goes outside the decode graph: the GPU timeline of a few engine
steps (torch.profiler / CUPTI), with the copies, sampling kernels and idle gaps around the graph.

Usage: PYTHONPATH=. python scripts/step_timeline.py [model] [steps]
Prints, per profiled step, every GPU operation that is not one of the decode graph's kernels (copies,
sampling, index fixes) and every idle gap over 2 us, then the totals: graph span, time outside it,
idle time.
"""

import json
import os
import sys
import tempfile

import torch

from pageflash import LLM, SamplingParams
from probe_timing import step_us  # scripts/probe_timing.py (this script's folder)

name = sys.argv[1] if len(sys.argv) > 1 else "llama-3-8b"
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6

llm = LLM(name, load_format="dummy")
eng = llm.llm_engine
eng.add_request(None, {"prompt_token_ids": list(range(10, 138))},
                SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
print(f"engine step (unprofiled): {step_us(eng, 100, warm=40):.1f} us")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
path = os.path.join(tempfile.mkdtemp(), "trace.json")
prof.export_chrome_trace(path)
ev = json.load(open(path))["traceEvents"]
gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
             key=lambda e: e["ts"])
# the decode graph's kernels: those launched many times per step (every layer); the rest is per step
from collections import Counter  # noqa: E402

counts = Counter(e["name"] for e in gpu)
graph_kernels = {n for n, c in counts.items() if c >= 16 * steps}
# a step boundary: the first kernel of the graph after a non-graph operation
out_dir = os.environ.get("OUT", ".")
with open(os.path.join(out_dir, "timeline.txt"), "w") as f:
    for e in gpu:
        f.write(f"{e['ts']:.1f} {e['dur']:.1f} {e.get('cat')} {e['name'][:100]}\n")
outside = idle = 0.0
prev_end = None
lines = []
for e in gpu:
    if prev_end is not None:
        gap = e["ts"] - prev_end
        if gap > 2.0:
            idle += gap
            lines.append(f"    idle {gap:7.1f} us before {e['name'][:60]}")
    if e["name"] not in graph_kernels:
        outside += e["dur"]
        lines.append(f"  {e.get('cat'):10s} {e['dur']:7.1f} us  {e['name'][:80]}")
    prev_end = max(prev_end or 0.0, e["ts"] + e["dur"])
span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
print("\n".join(lines[-60:]))
print(f"\n{steps} steps: GPU span {span:.0f} us ({span / steps:.1f} per step), outside the graph's kernels "
      f"{outside / steps:.1f} us per step, idle gaps > 2 us {idle / steps:.1f} us per step")
