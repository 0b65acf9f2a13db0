"""Where a LoRA prefill's time goes (GPU): llama-3-8b (dummy weights), one random rank-R adapter on
all seven projections, an eager prefill of T tokens, with and without the adapter.

    python scripts/lora_prefill_probe.py [--tokens 128 2048] [--rank 16] [--reps 5]

Per T: the prefill's wall time (prompt in, first token out: `LLM.generate` with max_tokens=1, prefix
caching off), its GPU busy time (sum of kernel durations under torch.profiler) and the host time of
the LoRA wrappers (cProfile cumulative time of LoRASlots.shrink / expand_). A prefill whose wall time
exceeds its GPU busy time by much is host-bound: the GPU waits on the launches.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile
import time

import torch

from pageflash import LLM, SamplingParams
from pageflash.lora import LoRARequest
from pageflash.lora.adapter import write_random_adapter


def prefill_ms(llm: LLM, prompt: list[int], lora, reps: int) -> float:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False, lora_request=lora)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def gpu_busy_ms(llm: LLM, prompt: list[int], lora) -> tuple[float, int]:
    from torch.profiler import ProfilerActivity, profile

    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False, lora_request=lora)
        torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]
    return sum(e["dur"] for e in ev) / 1e3, len(ev)


def host_profile(llm: LLM, prompt: list[int], lora) -> list[tuple[str, float, int]]:
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    pr = cProfile.Profile()
    pr.enable()
    llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False, lora_request=lora)
    torch.cuda.synchronize()
    pr.disable()
    st = pstats.Stats(pr)
    rows = []
    for (file, _, fn), (cc, nc, tt, ct, _) in st.stats.items():
        if "lora" in file or fn in ("lora_shrink", "lora_expand", "__call__") and "launch" in file:
            rows.append((f"{os.path.basename(file)}:{fn}", ct * 1e3, nc))
    return sorted(rows, key=lambda r: -r[1])[:12]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    llm = LLM("llama-3-8b", load_format="dummy", enable_lora=True, max_lora_rank=args.rank,
              enable_prefix_caching=False, max_num_batched_tokens=max(8192, max(args.tokens)))
    folder = tempfile.mkdtemp()
    path = write_random_adapter(os.path.join(folder, "a"), llm.llm_engine.runner.cfg, args.rank)
    lora = LoRARequest("a", 1, path)
    table = []
    for t in args.tokens:
        prompt = [(7 * i + 3) % 10000 for i in range(t)]
        for name, lo in (("base", None), ("lora", lora)):
            prefill_ms(llm, prompt, lo, 2)  # warm: compiles
            wall = prefill_ms(llm, prompt, lo, args.reps)
            busy, kernels = gpu_busy_ms(llm, prompt, lo)
            table.append((t, name, wall, busy, kernels))
            if lo is not None:
                for fn, ms, n in host_profile(llm, prompt, lo):
                    print(f"  T={t} host {fn:40s} {ms:8.2f} ms  {n} calls")
    print("| T | adapter | prefill wall ms | GPU kernels busy ms | kernels |")
    print("| --- | --- | --- | --- | --- |")
    for t, name, wall, busy, n in table:
        print(f"| {t} | {name} | {wall:.2f} | {busy:.2f} | {n} |")


if __name__ == "__main__":
    main()
