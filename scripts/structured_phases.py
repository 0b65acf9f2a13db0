"""Host time per engine phase, free vs constrained batches (wall time of each wrapped call, summed per
step), plus any Triton compile that happens inside the timed runs.

Usage: PYTHONPATH=.:/tmp/llg python scripts/structured_phases.py --model .carry/smollm2-tok
"""

import argparse
import collections
import functools
import time

import torch

from pageflash import LLM, SamplingParams, StructuredOutputsParams
from pageflash.engine import engine as engine_mod
from pageflash.engine import sampler as sampler_mod
from pageflash.engine import structured as structured_mod

T = collections.defaultdict(float)
N = collections.Counter()


def timed(owner, name, label):
    f = getattr(owner, name)

    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[label] += time.perf_counter() - t0
            N[label] += 1

    setattr(owner, name, g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, nargs="*", default=[0],
                    help="llguidance executor threads for the constrained rounds (0: its default)")
    args = ap.parse_args()
    try:
        import triton.compiler.compiler as tc

        orig = tc.compile

        def compile_logged(src, *a, **k):
            print(f"  triton compile: {getattr(src, 'name', getattr(getattr(src, 'fn', None), '__name__', src))}")
            return orig(src, *a, **k)

        tc.compile = compile_logged
        import triton

        triton.compile = compile_logged
    except Exception as e:  # noqa: BLE001
        print("no compile hook:", e)
    E = engine_mod.LLMEngine
    for name in ("step", "_resolve", "_launch", "_append_token"):
        timed(E, name, name)
    timed(sampler_mod.SamplingBatch, "build", "SamplingBatch.build")
    timed(sampler_mod.Sampler, "__call__", "Sampler()")
    timed(structured_mod.StructuredOutputs, "bitmasks", "bitmasks")
    llm = LLM(args.model, load_format="dummy", max_model_len=1024, max_num_seqs=128)
    eng = llm.llm_engine
    timed(eng.runner, "execute", "runner.execute")
    timed(eng.scheduler, "schedule", "schedule")
    n = args.batch
    tp = [[1 + (13 * i + j) % 5000 for j in range(32)] for i in range(n)]
    so = StructuredOutputsParams(json_object=True)
    import llguidance

    variants = ["free"] + [f"json_object t{t}" for t in args.threads]
    for r in range(args.rounds):
        for name in variants:
            if name != "free":
                t = int(name.split("t")[-1])
                eng.structured_outputs()._executor = llguidance.LLExecutor(num_threads=t or None)
            sp = SamplingParams(temperature=1.0, seed=3, max_tokens=args.max_tokens, ignore_eos=name == "free",
                                structured_outputs=so if name != "free" else None)
            T.clear()
            N.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(tp, [sp] * n, use_tqdm=False)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            steps = N["step"]
            print(f"round {r} {name}: {toks} tokens {dt:.3f} s = {toks / dt:.0f} tok/s, {steps} steps, "
                  f"{dt / steps * 1e3:.2f} ms/step")
            for k in sorted(T, key=T.get, reverse=True):
                print(f"    {k:22s} {T[k] / steps * 1e3:7.3f} ms/step  ({N[k]} calls)")
    # SamplingBatch.build alone, host time: B rows with and without a grammar bitmask
    import numpy as np

    words = eng.structured_outputs().words
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=1.0)
    for label, masks in (("no grammar", [None] * n),
                         ("grammar", [rng.integers(-2**31, 2**31, words, dtype=np.int64).astype(np.int32)
                                      for _ in range(n)])):
        rows = [sampler_mod.SamplingRow(sp, [1], (), None, m) for m in masks]
        for _ in range(5):
            sampler_mod.SamplingBatch.build(rows, eng.vocab_size, eng.device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            sampler_mod.SamplingBatch.build(rows, eng.vocab_size, eng.device)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"SamplingBatch.build B{n} {label}: {(t1 - t0) * 10:.3f} ms host per call "
              f"({(time.perf_counter() - t0) * 10:.3f} ms with the GPU work)")


if __name__ == "__main__":
    main()
