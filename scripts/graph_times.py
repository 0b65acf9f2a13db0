"""GPU time of a batch-1 verify-step graph against the plain decode graph (dummy smollm2-135m): replays
timed back to back, then the kernels of a few replays of each under torch.profiler.
Usage: [Q=6] python scripts/graph_times.py"""

import os

import torch
from torch.profiler import ProfilerActivity, profile

from pageflash import LLM, SamplingParams
from probe_timing import replay_us  # scripts/probe_timing.py (this script's folder)

Q = int(os.environ.get("Q", "6"))
llm = LLM("smollm2-135m", load_format="dummy", max_model_len=2048, num_kv_blocks=4096,
          speculative_config={"method": "ngram", "num_speculative_tokens": Q - 1})
prompt = {"prompt_token_ids": [i % 50 + 1000 for i in range(600)]}
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
runner = llm.llm_engine.runner
sg = runner.step_graphs
decode = runner.graphs.full[1].graph
verify_key = next(k for k in sg.graphs if k[0] == 1 and k[1] == Q)
verify = sg.graphs[verify_key][0]
print("verify graph key", verify_key)


for name, g in (("decode", decode), ("verify", verify)):
    print(f"{name}: {replay_us(g, reps=200, warm=10) / 1e3:.3f} ms per replay (back to back)")
for name, g in (("decode", decode), ("verify", verify)):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" if hasattr(e.device_type, "name") else True:
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t:
                rows[e.key] = (t / 5, e.count // 5)
    tot = sum(v[0] for v in rows.values())
    print(f"\n{name}: kernels per replay {sum(v[1] for v in rows.values())}, GPU kernel time {tot / 1e3:.3f} ms")
    for k, (t, c) in sorted(rows.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {t / 1e3:7.3f} ms  x{c:3d}  {k[:110]}")
