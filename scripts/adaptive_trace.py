"""What does the adaptive controller see at batch 1, against what the steps really cost? Runs the
bench's prompts one at a time with ngram+adaptive and records, per engine step: its period (start to
next start: what the throughput pays), the whole-step time and tokens the decoder reports to the
controller (observe_outcome / observe_step), and whether it speculated; prints both per step kind,
the controller's cost-model cells and calibration, and tok/s against plain decoding in the same
process. Usage: MODEL=path [TASK=grounded|chat T=0 N=16 MAX_TOKENS=128 K=5] python scripts/adaptive_trace.py"""

import argparse
import os
import statistics
import time

import torch

from pageflash import LLM, SamplingParams
from pageflash.bench.spec import _prompts

MODEL = os.environ["MODEL"]
TASK = os.environ.get("TASK", "grounded")
N = int(os.environ.get("N", "16"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "128"))
K = int(os.environ.get("K", "5"))
sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

llm = LLM(MODEL, max_model_len=2048, speculative_config={"method": "ngram", "num_speculative_tokens": K,
                                                          "adaptive": True})
eng = llm.llm_engine
spec = eng.spec
prompts = _prompts(eng, TASK, N, argparse.Namespace(text_tokens=1000, seed=0, max_tokens=MAX_TOKENS))
sp = SamplingParams(temperature=float(os.environ.get("T", "0")), max_tokens=MAX_TOKENS)


def gen(enabled: bool) -> float:
    spec.enabled = enabled
    llm.reset_prefix_cache()
    sync()
    t = time.perf_counter()
    n = 0
    for p in prompts:
        n += len(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids)
    sync()
    return n / (time.perf_counter() - t)


for _ in range(2):  # warm-up: compiles, graphs, controller state
    gen(False), gen(True)

log = []
ctrl = spec.ctrl
orig_out, orig_step, orig_engstep = ctrl.observe_outcome, ctrl.observe_step, eng.step
cur = {}


def observe_outcome(proposer, num_seqs, num_emitted, seconds, speculated):
    cur.update(whole=seconds, emitted=num_emitted, spec=speculated)
    return orig_out(proposer, num_seqs, num_emitted, seconds, speculated)


def observe_step(num_seqs, num_tokens, seconds):
    cur.update(fwd=seconds, tokens=num_tokens)
    return orig_step(num_seqs, num_tokens, seconds)


def step(*a, **k):
    cur.clear()
    cur["t0"] = time.perf_counter()
    cur["overlap"] = eng._inflight is not None
    out = orig_engstep(*a, **k)
    log.append(dict(cur))
    return out


ctrl.observe_outcome, ctrl.observe_step, eng.step = observe_outcome, observe_step, step
rates = {"plain": [], "adaptive": []}
for _ in range(3):
    ctrl.observe_outcome, ctrl.observe_step, eng.step = orig_out, orig_step, orig_engstep
    rates["plain"].append(gen(False))
    ctrl.observe_outcome, ctrl.observe_step, eng.step = observe_outcome, observe_step, step
    log.clear()
    rates["adaptive"].append(gen(True))
for i in range(len(log) - 1):
    log[i]["period"] = log[i + 1]["t0"] - log[i]["t0"]
kinds = {}
for e in log[:-1]:
    if "whole" not in e:
        continue
    kind = "spec" if e["spec"] else ("plain-overlapped" if e["overlap"] else "plain-sync")
    kinds.setdefault(kind, []).append(e)
print(f"{TASK} T={sp.temperature}: tok/s plain {[round(x) for x in rates['plain']]}, "
      f"adaptive {[round(x) for x in rates['adaptive']]}")
print(f"{'step kind':18s} {'count':>6s} {'period ms':>10s} {'whole ms':>9s} {'fwd ms':>7s} {'emitted':>8s}")
for kind, es in sorted(kinds.items()):
    def med(key):
        return statistics.median(e[key] for e in es if key in e) * (1e3 if key != "emitted" else 1)
    print(f"{kind:18s} {len(es):6d} {med('period'):10.3f} {med('whole'):9.3f} {med('fwd'):7.3f} {med('emitted'):8.2f}")
print("cost model (bucket 1):", {n: round(s * 1e3, 3) for n, s in sorted(ctrl.costs._cells.get((1, False), {}).items())})
print("controller:", ctrl.as_dict())
