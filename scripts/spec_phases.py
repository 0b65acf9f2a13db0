"""Host time per phase of batch-1 steps, plain vs n-gram speculation (dummy smollm2-135m, repetitive
prompt so that drafts are found): each phase's wall time per step, measured by wrapping the engine's
methods (no added syncs; the wait for the GPU lands in the phase that reads results).
Usage: [MAX_TOKENS=256 SPEC=ngram|ngram-tree MODEL=path] python scripts/spec_phases.py"""

import collections
import functools
import os
import time

import torch

import pageflash.spec.decoding as decoding
from pageflash import LLM, SamplingParams

sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "256"))
prompt = {"prompt_token_ids": [(i * 7919) % 20000 + 1000 for i in range(64)] * 8}


def wrap(obj, name, acc, label=None):
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[label or name] += time.perf_counter() - t

    setattr(obj, name, w)


def run(spec):
    model = os.environ.get("MODEL")  # a real model (path): detokenization and its tokenizer's EOS included
    llm = LLM(model or "smollm2-135m", load_format="auto" if model else "dummy", max_model_len=2048,
              num_kv_blocks=4096, speculative_config=spec)
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(3):
        llm.reset_prefix_cache()
        llm.generate([prompt], sp, use_tqdm=False)
    acc = collections.defaultdict(float)
    wrap(eng, "step", acc, "step (all)")
    wrap(eng.scheduler, "schedule", acc)
    wrap(eng.runner, "execute", acc, "runner.execute")
    if eng.runner.step_graphs is not None:
        wrap(eng.runner.step_graphs, "run", acc, "  step_graphs.run")
        wrap(eng.runner, "prepare", acc, "  runner.prepare")
        import pageflash.engine.model_runner as mr
        wrap(mr, "copy_to", acc, "    copy_to (H2D inputs)")
        wrap(torch.cuda.CUDAGraph, "replay", acc, "    CUDAGraph.replay")
    wrap(eng, "_launch", acc)
    wrap(eng, "_resolve", acc)
    wrap(eng, "_outputs", acc)
    wrap(eng, "_append_token", acc, "  _append_token")
    if eng.spec is not None:
        d = eng.spec
        for n in ("propose", "execute_kwargs", "finish_step", "_verify", "_compact_kv", "_logprobs"):
            wrap(d, n, acc, ("  " if n in ("_verify",) else "    " if n.startswith("_") else "spec.") + n)
        wrap(d.proposer, "propose", acc, "  proposer.propose")
        wrap(decoding, "verify_chains", acc, "    verify_chains")
        wrap(decoding, "verify_trees", acc, "    verify_trees")
    llm.reset_prefix_cache()
    eng.add_request(None, prompt, sp)
    saved = dict(acc)
    eng.step()  # the prefill, left out of the per-step figures
    acc.clear()
    acc.update({k: 0.0 for k in saved})
    steps = 0
    sync()
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    sync()
    wall = time.perf_counter() - t
    print(f"\n== spec={spec}: {(MAX_TOKENS - 1) / wall:.0f} tok/s (prefill excluded), {steps} steps, {wall / steps * 1e3:.3f} ms/step")
    for k, v in acc.items():
        print(f"  {k:28s} {v / steps * 1e3:7.3f} ms/step")


run(None)
kind = os.environ.get("SPEC", "ngram")
run({"method": "ngram", "num_speculative_tokens": 5} if kind == "ngram" else
    {"method": "ngram", "num_speculative_tokens": 15, "tree": [3]})
