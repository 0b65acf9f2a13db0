"""Interleaved A/B of two versions of pageflash/engine/model_runner.py's graph classes in ONE process
(the host's speed differs between processes by up to ~1.5x, so separate runs cannot show a 10% host
change). Engine A uses the working tree's DecodeGraphs / StepGraphs, engine B those of OLD (a copy of
model_runner.py from another commit, e.g. `git show HEAD~1:pageflash/engine/model_runner.py > /tmp/old.py`);
the rounds alternate A, B, A, B, ... on the dummy smollm2-135m config: batch-1 n-gram speculation on a
repetitive prompt (verify steps through StepGraphs) and plain decode waves (DecodeGraphs).
Usage: OLD=/tmp/old.py [ROUNDS=5 B=64] python scripts/ab_runner.py"""

import importlib.util
import os
import random
import statistics
import sys
import time

import torch

import pageflash.engine.model_runner as mr
from pageflash import LLM, SamplingParams

ROUNDS = int(os.environ.get("ROUNDS", "5"))
B = int(os.environ.get("B", "64"))
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

spec_ = importlib.util.spec_from_file_location("old_model_runner", os.environ["OLD"])
old = importlib.util.module_from_spec(spec_)
sys.modules["old_model_runner"] = old  # (dataclasses look their module up)
spec_.loader.exec_module(old)


def engines(**kw):
    a = LLM("smollm2-135m", load_format="dummy", max_model_len=2048, **kw)
    saved = mr.DecodeGraphs, mr.StepGraphs
    mr.DecodeGraphs, mr.StepGraphs = old.DecodeGraphs, old.StepGraphs
    try:
        b = LLM("smollm2-135m", load_format="dummy", max_model_len=2048, **kw)
    finally:
        mr.DecodeGraphs, mr.StepGraphs = saved
    return {"A (tree)": a, "B (OLD)": b}


def rounds(llms, prompts, sp, label):
    times = {k: [] for k in llms}
    for llm in llms.values():  # warm-up: compiles, captures
        for _ in range(2):
            llm.reset_prefix_cache()
            llm.generate(prompts, sp, use_tqdm=False)
    for _ in range(ROUNDS):
        for k, llm in llms.items():
            llm.reset_prefix_cache()
            sync()
            t = time.perf_counter()
            out = llm.generate(prompts, sp, use_tqdm=False)
            sync()
            n = sum(len(o.outputs[0].token_ids) for o in out)
            times[k].append(n / (time.perf_counter() - t))
    for k, v in times.items():
        print(f"{label:34s} {k:9s} median {statistics.median(v):9.0f} tok/s  rounds {[round(x) for x in v]}")
    return times


rng = random.Random(0)
sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
rep = [{"prompt_token_ids": [(i * 7919) % 20000 + 1000 for i in range(64)] * 8}]
llms = engines(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
rounds(llms, rep, sp, "batch 1, ngram k=5, repetitive")
tree = engines(speculative_config={"method": "ngram", "num_speculative_tokens": 15, "tree": [3]})
rounds(tree, rep, sp, "batch 1, ngram-tree 3x5, repetitive")
del llms, tree
plain = engines(max_num_seqs=256)
waves = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(rng.randrange(30, 90))]} for _ in range(4 * B)]
rounds(plain, rep, sp, "batch 1, plain")
rounds(plain, waves, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True), f"{4 * B} prompts, plain (max_num_seqs 256)")
