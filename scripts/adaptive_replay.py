"""Replay of the adaptive controller over real acceptance sequences, on the CPU (no GPU needed).

1. Greedy outputs of MODEL (float32, CPU) for the bench's 16 grounded and 16 chat prompts, 128
   tokens each, cached in OUTS (default /tmp/spec_outs.json).
2. For every output position, the n-gram draft (k = K) made from the history and how many of its
   tokens the output then matched: P(first token accepted | last draft hit / missed) and the mean.
3. The SpecController run over those sequences with a synthetic clock (plain overlapped step 1.0 ms,
   verify step 1.45 ms, synchronous plain step 1.2 ms, +-10% noise; shadow drafts judged two tokens
   late, as in the engine), against fixed k and plain, in tok/ms.
Usage: MODEL=SmolLM2-135M-Instruct.Q4_1.gguf [K=5 OUTS=/tmp/spec_outs.json] python scripts/adaptive_replay.py"""

import argparse
import json
import os
import random

import numpy as np

from pageflash.spec.adaptive import AdaptiveConfig, SpecController
from pageflash.spec.ngram import ngram_lookup

K = int(os.environ.get("K", "5"))
OUTS = os.environ.get("OUTS", "/tmp/spec_outs.json")
PLAIN, VERIFY, SYNC_PLAIN = 1.0e-3, 1.45e-3, 1.2e-3

if not os.path.exists(OUTS):
    from pageflash import LLM, SamplingParams
    from pageflash.bench.spec import _prompts

    llm = LLM(os.environ["MODEL"], max_model_len=4096, dtype="float32")
    a = argparse.Namespace(text_tokens=1000, seed=0, max_tokens=128)
    res = {}
    for task in ("grounded", "chat"):
        ps = _prompts(llm.llm_engine, task, 16, a)
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
        res[task] = [(p["prompt_token_ids"], list(o.outputs[0].token_ids)) for p, o in zip(ps, outs)]
    with open(OUTS, "w") as f:
        json.dump(res, f)
with open(OUTS) as f:
    res = json.load(f)


def accepted(prompt, out, i, k):
    d = ngram_lookup(np.asarray(prompt + out[:i], dtype=np.int64), 1, 4, k)
    if d is None:
        return None
    a = 0
    while a < len(d) and i + a < len(out) and d[a] == out[i + a]:
        a += 1
    return a


def replay(seqs, accs, policy, rounds=3, seed=0):
    rng = random.Random(seed)
    ctrl = SpecController(AdaptiveConfig(k_max=K, probe_k=min(2, K)))
    rates = []
    for rnd in range(rounds):
        tok, t = 0, 0.0
        for n_, ((p, o), acc) in enumerate(zip(seqs, accs)):
            rid, i, was_spec, judged, n = f"{rnd}-{n_}", 0, False, -1, len(o)
            while i < n:
                noise = rng.uniform(0.9, 1.1)
                if policy == "adaptive" and not was_spec and i >= 2 and acc[i - 2] is not None and judged != i - 2:
                    ctrl.observe_acceptance("ngram", rid, K, acc[i - 2])  # shadow draft, two tokens late
                    judged = i - 2
                if policy == "plain":
                    k = 0
                elif policy == "fixed":
                    k = K
                else:
                    k = 0 if ctrl.skip_step("ngram", 1) else ctrl.choose([rid], "ngram", [K], prechecked=True)[0]
                if k > 0 and acc[i] is None:  # nothing to draft: a synchronous plain step
                    cost, em, spec = SYNC_PLAIN, 1, False
                elif k > 0:
                    a = acc[i] if k == K else accepted(p, o, i, k)
                    cost, em, spec = VERIFY, min(a + 1, n - i), True
                    ctrl.observe_acceptance("ngram", rid, k, a)
                else:
                    cost, em, spec = (SYNC_PLAIN if was_spec else PLAIN), 1, False
                cost *= noise
                ctrl.observe_step(1, 1 + (k if spec else 0), cost)
                ctrl.observe_outcome("ngram", 1, em, cost, speculated=spec)
                i, t, tok, was_spec = i + em, t + cost, tok + em, k > 0
            ctrl.remove_request(rid)
        rates.append(round(tok / t / 1e3, 3))
    return rates


for task, seqs in res.items():
    accs = [[accepted(p, o, i, K) for i in range(len(o))] for p, o in seqs]
    trans: dict[bool, list[int]] = {}
    for acc in accs:
        prev = None
        for a in acc:
            if a is None:
                continue
            if prev is not None:
                trans.setdefault(prev, []).append(a)
            prev = a >= 1
    cond = {("after hit" if h else "after miss"): (round(float(np.mean([x >= 1 for x in v])), 3),
                                                  round(float(np.mean(v)), 2)) for h, v in trans.items()}
    print(f"{task}: P(first accepted), mean accepted {cond}")
    for policy in ("plain", "fixed", "adaptive"):
        print(f"  {policy:9s} tok/ms per round {replay(seqs, accs, policy)}")
