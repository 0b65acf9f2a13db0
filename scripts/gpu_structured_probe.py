"""Structured outputs on the GPU: constraints hold under CUDA graphs, async scheduling and n-gram
speculation, and what a constraint costs a batch's throughput.

Usage (device machine; llguidance installed from a carried wheel, a tokenizer folder carried):
    # here: the folder (a named config's config.json + the embedded model's tokenizer, ~3.5 MB) and the wheel
    python scripts/gpu_structured_probe.py --make-model .carry/smollm2-tok --config smollm2-135m
    python scripts/gpu_structured_probe.py --make-model .carry/llama8b-tok --config llama-3-8b
    pip download --no-deps llguidance -d .carry/wheels
    # device (carry .carry/wheels and the folder):
    pip install --no-deps --no-index --target /tmp/llg .carry/wheels/llguidance-*.whl
    PYTHONPATH=.:/tmp/llg python scripts/gpu_structured_probe.py --model .carry/smollm2-tok [--out DIR]

The model folder holds config.json and the tokenizer only: weights are random (load_format="dummy"), so
the text is noise, which is what a constraint has to hold against. Checks, each printed as a line:
  1. a mixed batch (JSON schema, json_object, regex, choice, Lark grammar, free; greedy and sampled;
     n > 1), default engine (bf16, CUDA graphs, async scheduling): every constrained output is accepted
     by a fresh matcher token by token, and a stopped output is a complete match (json.loads / fullmatch);
  2. float32, the same batch greedy: plain engine vs n-gram speculation, token for token;
  3. throughput: batch 64 x 128 tokens, free (ignore_eos) vs json_object-constrained, the latter with
     async scheduling and without (steps not overlapped); and the time of one step's bitmasks alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import torch

from pageflash import LLM, SamplingParams, StructuredOutputsParams

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CASES = [
    ("json", StructuredOutputsParams(json=PERSON)),
    ("json_object", StructuredOutputsParams(json_object=True)),
    ("regex", StructuredOutputsParams(regex=r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}")),
    ("choice", StructuredOutputsParams(choice=["red", "green", "blue"])),
    ("grammar", StructuredOutputsParams(grammar='start: ("yes" | "no") " because " /[a-z ]{1,20}/ "."')),
    ("free", None),
]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def complete(kind: str, text: str) -> bool:
    if kind in ("json", "json_object"):
        try:
            v = json.loads(text)
        except ValueError:
            return False
        return isinstance(v, dict) and (kind == "json_object" or set(v) == {"name", "age"})
    if kind == "regex":
        return re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", text) is not None
    if kind == "choice":
        return text in ("red", "green", "blue")
    if kind == "grammar":
        return re.fullmatch(r"(yes|no) because [a-z ]{1,20}\.", text) is not None
    return True


def batch(n_each: int, greedy_only: bool = False):
    prompts, params, kinds = [], [], []
    for i in range(n_each):
        for kind, so in CASES:
            temp = 0.0 if greedy_only or i % 2 == 0 else 1.0
            n = 1 if greedy_only or i % 3 else 2
            prompts.append([1 + (7 * i + len(kind)) % 5000 for _ in range(8 + i % 13)])
            params.append(SamplingParams(temperature=temp, seed=i, n=n, max_tokens=48, structured_outputs=so))
            kinds.append(kind)
    return prompts, params, kinds


def check(llm: LLM, outs, params, kinds) -> tuple[int, int, int]:
    eng = llm.llm_engine
    so_engine = eng.structured_outputs()
    held = stopped_ok = total = 0
    for o, p, kind in zip(outs, params, kinds):
        for c in o.outputs:
            if p.structured_outputs is None:
                continue
            total += 1
            m = so_engine.matcher(p.structured_outputs)
            ok = m.consume_tokens([t for t in c.token_ids if t not in eng.eos_token_ids])
            held += ok
            if c.finish_reason == "stop":
                stopped_ok += complete(kind, c.text)
            else:
                stopped_ok += 1  # cut by max_tokens: only the prefix check applies
            if not ok or (c.finish_reason == "stop" and not complete(kind, c.text)):
                print(f"  FAIL {kind}: {c.finish_reason} {c.text!r}")
    return held, stopped_ok, total


def make_model(folder: str, config: str) -> None:
    """A model folder for load_format="dummy": a named config's config.json and the tokenizer of the
    embedded default model (the only one on hand without a model hub)."""
    from pageflash.model.loader import load_tokenizer, resolve_model
    from pageflash.model.registry import NAMED_CONFIGS

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(NAMED_CONFIGS[config], f)
    load_tokenizer(resolve_model("smollm2-135m")).save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--make-model", metavar="DIR", help="write a config + tokenizer folder and exit")
    ap.add_argument("--config", default="smollm2-135m", help="named config for --make-model")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--each", type=int, default=8, help="requests per constraint kind in the mixed batch")
    ap.add_argument("--batch", type=int, default=64, help="throughput batch")
    ap.add_argument("--no-fp32", action="store_true", help="skip check 2 (two float32 engines: large models)")
    args = ap.parse_args()
    if args.make_model:
        make_model(args.make_model, args.config)
        return
    if not args.model:
        ap.error("--model is required")
    rows = []
    common = dict(load_format="dummy", max_model_len=1024, max_num_seqs=128)

    llm = LLM(args.model, **common)
    prompts, params, kinds = batch(args.each)
    outs = llm.generate(prompts, params, use_tqdm=False)
    held, ok, total = check(llm, outs, params, kinds)
    kv = llm.llm_engine.kv
    rows.append(("mixed batch, bf16 graphs async", f"{held}/{total} prefixes accepted, {ok}/{total} complete-or-cut",
                 f"free blocks {kv.num_free_blocks}/{kv.pool.num_blocks}"))

    # 3. throughput, same engine
    n = args.batch
    tp = [[1 + (13 * i + j) % 5000 for j in range(32)] for i in range(n)]
    so = StructuredOutputsParams(json_object=True)
    res = {}
    eng = llm.llm_engine
    for r in range(args.rounds):
        for name in ("free", "json_object", "json_object sync"):
            sp = SamplingParams(temperature=1.0, seed=3, max_tokens=128,
                                structured_outputs=so if name != "free" else None,
                                ignore_eos=name == "free")
            eng._async_scheduling = name != "json_object sync"  # the same engine, steps not overlapped
            sync()
            t0 = time.perf_counter()
            o = llm.generate(tp, [sp] * n, use_tqdm=False)
            sync()
            dt = time.perf_counter() - t0
            toks = sum(len(x.outputs[0].token_ids) for x in o)
            res.setdefault(name, []).append((toks / dt, toks, dt))
    eng._async_scheduling = True
    # the host's mask work alone: B matchers inside a JSON string, llguidance's thread pool
    tok = eng.tokenizer
    prefix = tok.encode('{"name": "Jo', add_special_tokens=False)
    ms = []
    for _ in range(n):
        m = eng.structured_outputs().matcher(so)
        assert m.consume_tokens(prefix)
        ms.append(m)
    eng.structured_outputs().bitmasks(ms)
    t0 = time.perf_counter()
    for _ in range(20):
        eng.structured_outputs().bitmasks(ms)
    rows.append((f"bitmasks() of {n} matchers mid-string", f"{(time.perf_counter() - t0) / 20 * 1e3:.2f} ms", ""))
    for name, v in res.items():
        rates = sorted(x[0] for x in v)
        rows.append((f"throughput B{n} {name}", f"{rates[len(rates) // 2]:.0f} tok/s (median of {len(v)})",
                     f"tokens {v[-1][1]}, rounds {[round(x[0]) for x in v]}"))
    del llm
    empty_cache()

    # 2. float32 plain vs ngram, greedy
    prompts, params, kinds = batch(max(1, args.each // 2), greedy_only=True)
    got = {"plain": [], "ngram": []}
    for name, kw in () if args.no_fp32 else (
            ("plain", {}), ("ngram", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4}})):
        llm = LLM(args.model, dtype="float32", **common, **kw)
        outs = llm.generate(prompts, params, use_tqdm=False)
        got[name] = [c.token_ids for o in outs for c in o.outputs]
        held, ok, total = check(llm, outs, params, kinds)
        rows.append((f"fp32 greedy {name}", f"{held}/{total} prefixes accepted, {ok}/{total} complete-or-cut", ""))
        del llm
        empty_cache()
    if not args.no_fp32:
        same = sum(a == b for a, b in zip(got["plain"], got["ngram"]))
        rows.append(("fp32 greedy ngram == plain", f"{same}/{len(got['plain'])}", ""))

    with open(os.path.join(args.out, "structured_probe.json"), "w") as f:
        json.dump({"rows": rows, "throughput": res}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}")
    for r in rows:
        print(" | ".join(str(x) for x in r))


if __name__ == "__main__":
    main()
