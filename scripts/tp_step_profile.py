"""Two GPUs: a GPU timeline of rank 0's real decode steps at batch 64 (run 49: the bucket-64 cliff with
the full-width block-table copy, PAGEFLASH_DECODE_BT_COPY=full, against the narrowed copy).
    PAGEFLASH_DECODE_BT_COPY=full python scripts/tp_step_profile.py OUT_PREFIX [TP] [BATCH] [INPUT_LEN] [STEPS]
Prints the step times, the GPU's busy time per step, the host-to-device copies' durations and the
largest idle gaps on rank 0's GPU with the events around them; writes a chrome trace to OUT_PREFIX.json.gz."""
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pageflash import LLM
from pageflash.sampling_params import SamplingParams

if __name__ == "__main__":
    prefix = sys.argv[1]
    tp = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    input_len = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    steps = int(sys.argv[5]) if len(sys.argv) > 5 else 15
    llm = LLM("llama-3-8b", load_format="dummy", tensor_parallel_size=tp)
    eng = llm.llm_engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(None, {"prompt_token_ids": [rng.randrange(1000, 30000) for _ in range(input_len)]}, params)
    for _ in range(20 + batch * input_len // 8192):  # prefill and warm decode steps
        eng.step()
    torch.cuda.synchronize()
    times = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            times.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
    print("step ms:", " ".join(f"{t:.2f}" for t in times))
    prof.export_chrome_trace(prefix + ".json")
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ev.sort(key=lambda e: e.time_range.start)
    if ev:
        span = ev[-1].time_range.end - ev[0].time_range.start
        busy, end, gaps = 0.0, ev[0].time_range.start, []
        for prev, e in zip([None] + ev[:-1], ev):
            s, f = e.time_range.start, e.time_range.end
            if s > end:
                gaps.append((s - end, prev.name if prev else "", e.name))
            busy += max(0.0, f - max(s, end))
            end = max(end, f)
        print(f"rank0 GPU: span {span / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms over {steps} steps "
              f"({busy / steps / 1e3:.2f} ms a step)")
        for g, a, b in sorted(gaps, reverse=True)[:12]:
            print(f"  gap {g:8.1f} us after {a[:60]!r} before {b[:60]!r}")
        cp = [e for e in ev if "memcpy" in e.name.lower() or "Memcpy" in e.name]
        print("copies (us):", " ".join(f"{e.name.split()[1] if ' ' in e.name else e.name}:{e.time_range.elapsed_us():.1f}"
                                      for e in cp[:60]))
        allr = [e for e in ev if "nccl" in e.name.lower()]
        if allr:
            d = sorted(e.time_range.elapsed_us() for e in allr)
            print(f"nccl kernels: {len(allr)}, median {d[len(d) // 2]:.1f} us, max {d[-1]:.1f}, "
                  f"sum {sum(d) / 1e3:.2f} ms")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=14))
    llm.shutdown()
