"""Speculative decoding: ``pageflash bench spec [--methods ngram early_exit medusa ...] [--json F]``.

W-spec (../shared/WORKLOADS.md): tok/s with speculation over tok/s without, in the same engine and
the same run, with acceptance rate and mean accepted tokens per step, for each method on

- grounded: summarize / repeat / rewrite / fix a given text of ~--text-tokens tokens (held-out
  pydoc topics shipped with Python, ``pageflash.spec.corpus``), where drafts can copy the input;
- chat: free questions with nothing to copy;

at each --batch-size (requests run in waves of that many, all submitted at once) and each
--temperature (0 = greedy; greedy runs also report whether the tokens equal the baseline's).

One engine serves every method: the baseline runs with speculation switched off, each method swaps
its own SpecDecoder in (the draft model, when asked for, is loaded with the engine so that the KV
pool is sized with it). Methods: ngram, early_exit, medusa, draft_model, each with a "-tree"
variant (SpecInfer tree --tree, or --ngram-width merged n-gram continuations) and an "+adaptive"
suffix (the SpecController picks k per request, and switches speculation off when it would not pay).
Medusa heads come from --medusa-path, else they are trained first on this engine with
``pageflash.spec.train_medusa`` (the training split of the topics, never the held-out one).

    pageflash bench spec --json spec.json                               # W-spec on the default model
    pageflash bench spec --methods ngram --batch-size 1 --temperature 0 --num-prompts 2 --max-tokens 16
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

from pageflash.bench.latency import env_info, fmt, format_table, sync
from pageflash.model.registry import DEFAULT_MODEL

METHODS = ("ngram", "ngram-tree", "early_exit", "early_exit-tree", "medusa", "medusa-tree",
           "draft_model", "draft_model-tree")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pageflash bench spec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["ngram", "ngram-tree", "early_exit", "medusa", "medusa-tree"],
                   help=f"any of {', '.join(METHODS)}, each optionally with @K (its own k instead of --k; "
                        f"for ngram-tree the depth of each continuation) and +adaptive, e.g. ngram@10+adaptive "
                        f"(default: %(default)s)")
    p.add_argument("--tasks", nargs="+", default=["grounded", "chat"], choices=["grounded", "chat"])
    p.add_argument("--batch-size", type=int, nargs="+", default=[1, 64])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--num-prompts", type=int, default=4,
                   help="prompts per cell (at least one wave of --batch-size) (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--num-iters", type=int, default=3,
                   help="timed rounds per cell; a round runs each wave of --batch-size prompts with the baseline "
                        "and every method back to back (so drifts hit all alike); tok/s are medians over "
                        "rounds, speedups the median of each round's own ratio (default: 3)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument("--text-tokens", type=int, default=1000, help="quoted text of grounded prompts")
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens of chains (default: %(default)s)")
    p.add_argument("--tree", default="3,2,1", help="SpecInfer expansion of the -tree variants (default: %(default)s)")
    p.add_argument("--ngram-width", type=int, default=3, help="continuations merged by ngram-tree")
    p.add_argument("--early-exit-layers", type=int, default=None, help="default: half the target's layers")
    p.add_argument("--draft-model", default=None, help="draft model of the draft_model methods")
    p.add_argument("--medusa-path", default=None, help="trained heads (default: train them here first)")
    p.add_argument("--medusa-train-prompts", type=int, default=256)
    p.add_argument("--medusa-train-tokens", type=int, default=256)
    p.add_argument("--medusa-epochs", type=int, default=2)
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default="auto")
    g.add_argument("--load-format", default="auto")
    g.add_argument("--max-model-len", type=int, default=2048)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--quantization", "-q", default=None, choices=["int8", "fp8"],
                   help="quantization of the target at load: int8 or fp8 (default: none)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8", "fp8_e4m3"],
                   help="KV cache element type (default: the model's dtype)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap host work with the device in steps without drafts (default: on for CUDA)")
    g.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    for m in a.methods:
        try:
            parse_method(m)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        if m.startswith("draft_model") and not a.draft_model:
            print("error: the draft_model methods need --draft-model", file=sys.stderr)
            return 2
    if min(a.batch_size) < 1 or a.num_prompts < 1 or a.max_tokens < 1 or a.k < 1 or a.num_iters < 1:
        print("error: --batch-size, --num-prompts, --max-tokens, --k and --num-iters must be >= 1", file=sys.stderr)
        return 2
    try:
        return _run(a, argv)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def parse_method(method: str) -> tuple[str, Optional[int], bool]:
    """'ngram-tree@8+adaptive' -> ('ngram-tree', 8, True): the base method, its own k (None: --k),
    and whether the adaptive controller drives it. Raises ValueError on an unknown method or k."""
    adaptive = method.endswith("+adaptive")
    base, at, k = method.removesuffix("+adaptive").partition("@")
    if base not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)} (optionally @K, +adaptive)")
    if at and not (k.isdigit() and int(k) >= 1):
        raise ValueError(f"method {method!r}: the k after '@' must be an integer >= 1")
    return base, int(k) if at else None, adaptive


def spec_config(method: str, a: argparse.Namespace, num_layers: int, medusa_path: Optional[str]) -> dict:
    base, k, adaptive = parse_method(method)
    k = a.k if k is None else k
    kind, _, tree = base.partition("-")
    tree_cfg = [int(x) for x in a.tree.split(",")]
    cfg: dict[str, Any] = {"method": kind, "adaptive": adaptive}
    if kind == "ngram":
        cfg.update(num_speculative_tokens=k * (a.ngram_width if tree else 1))
        if tree:
            cfg["tree"] = [a.ngram_width]
    elif tree:
        cfg["tree"] = tree_cfg
    else:
        cfg["num_speculative_tokens"] = k
    if kind == "early_exit":
        cfg["num_layers"] = a.early_exit_layers or max(1, num_layers // 2)
    elif kind == "medusa":
        cfg["medusa_path"] = medusa_path
        if not tree:
            cfg["num_speculative_tokens"] = min(k, _medusa_heads(medusa_path))
    elif kind == "draft_model":
        cfg["model"] = a.draft_model
    return cfg


def _medusa_heads(path: str) -> int:
    from pageflash.spec.medusa import load_heads

    return load_heads(path).config.num_heads


def _prompts(eng, task: str, n: int, a: argparse.Namespace) -> list[dict]:
    """n prompts of a task as engine inputs (chat template applied); random ids without a tokenizer."""
    from pageflash.spec.corpus import build_prompts, chat_prompt

    tok = eng.tokenizer
    if tok is None:  # tiny random test models: a random text, repeated for the grounded task
        import random

        rng = random.Random(a.seed + (task == "chat"))
        out = []
        for _ in range(n):
            text = [rng.randrange(eng.vocab_size) for _ in range(max(2, a.text_tokens // 2))]
            out.append({"prompt_token_ids": text * 2 if task == "grounded" else text})
        return out
    msgs = build_prompts(task, n, "heldout", a.text_tokens, a.seed, lambda s: len(tok.encode(s)))
    prompts = [chat_prompt(tok, m) for m in msgs]
    limit = eng.max_model_len - a.max_tokens
    too_long = [len(p["prompt_token_ids"]) for p in prompts if len(p["prompt_token_ids"]) >= limit]
    if too_long:
        raise ValueError(f"a {task} prompt has {max(too_long)} tokens; raise --max-model-len above "
                         f"{max(too_long) + a.max_tokens} or lower --text-tokens")
    return prompts


def run_waves(eng, prompts: list[dict], params, batch: int) -> tuple[list, float]:
    """Run prompts in waves of `batch` (all of a wave submitted at once); (outputs, seconds).
    Starts from an empty prefix cache, so that every run computes its prompts (the runs repeat the
    same prompts: otherwise each task's first run would be the only one without cache hits)."""
    outs: list = []
    eng.reset_prefix_cache()
    sync(eng.device)
    t0 = time.perf_counter()
    for w in range(0, len(prompts), batch):
        ids = [eng.add_request(None, p, params) for p in prompts[w : w + batch]]
        done: dict[str, Any] = {}
        while len(done) < len(ids):
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o
        outs.extend(done[i] for i in ids)
    sync(eng.device)
    return outs, time.perf_counter() - t0


def _run(a: argparse.Namespace, argv: list[str]) -> int:
    import torch

    from pageflash import LLM, SamplingParams
    from pageflash.spec.config import SpeculativeConfig
    from pageflash.spec.decoding import SpecDecoder

    def log(msg: str) -> None:
        print(f"[bench spec] {msg}", file=sys.stderr, flush=True)

    kw: dict[str, Any] = dict(model=a.model, dtype=a.dtype, device=a.device, load_format=a.load_format,
                              max_model_len=a.max_model_len, seed=a.seed, enforce_eager=a.enforce_eager,
                              async_scheduling=a.async_scheduling, quantization=a.quantization,
                              kv_cache_dtype=a.kv_cache_dtype)
    for k in ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(a, k) is not None:
            kw[k] = getattr(a, k)
    if a.max_num_seqs is None:
        kw["max_num_seqs"] = max(256, max(a.batch_size))
    # The draft model, if any, comes with the engine so that the KV pool is sized with it in memory.
    first = next((m for m in a.methods if m.startswith("draft_model")), None)
    medusa_path = a.medusa_path
    tmp = None
    t0 = time.perf_counter()
    if first is None:
        llm = LLM(**kw)
        n_layers = llm.llm_engine.model_config.num_hidden_layers
    else:
        from pageflash.model.loader import load_config, resolve_model

        n_layers = load_config(resolve_model(a.model, a.load_format)).num_hidden_layers
        llm = LLM(**kw, speculative_config=spec_config(first, a, n_layers, None))
    eng = llm.llm_engine
    init_s = time.perf_counter() - t0
    log(f"engine ready in {init_s:.1f} s on {eng.device}")
    owned = eng.spec
    medusa_summary = None
    if any(m.startswith("medusa") for m in a.methods) and not medusa_path:
        from pageflash.spec.medusa import save_heads
        from pageflash.spec.train_medusa import train_on_engine

        log(f"training Medusa heads ({a.medusa_train_prompts} prompts x {a.medusa_train_tokens} tokens)")
        heads, medusa_summary = train_on_engine(
            llm, num_prompts=a.medusa_train_prompts, max_tokens=a.medusa_train_tokens,
            text_tokens=min(400, a.text_tokens), epochs=a.medusa_epochs, seed=a.seed, log=log,
            base_model=str(a.model),
        )
        tmp = tempfile.mkdtemp(prefix="pageflash-medusa-")
        medusa_path = os.path.join(tmp, "heads.safetensors")
        save_heads(heads, medusa_path)
        log(f"val top-1 per head: {medusa_summary['val_top1_per_head']}")

    prompt_sets = {t: _prompts(eng, t, max(a.num_prompts, max(a.batch_size)), a) for t in a.tasks}
    decoders: dict[str, Any] = {}
    for m in a.methods:
        cfg = SpeculativeConfig.parse(spec_config(m, a, n_layers, medusa_path))
        if owned is not None and m == first:
            decoders[m] = owned
        else:
            d = SpecDecoder(eng, cfg)
            d.bind(eng.kv.pool.num_blocks)
            decoders[m] = d
    # Warm-up: every path at every batch size, twice (Triton compiles, tree masks, the draft model,
    # and the CUDA graphs of verify / draft step shapes, captured when a shape recurs).
    warm = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    t0 = time.perf_counter()
    for b in sorted(set(a.batch_size)):
        for task in a.tasks:  # each task's prompt lengths (kernel variants of their own)
            wp = prompt_sets[task][:b]
            for d in [None, *decoders.values()]:
                eng.spec = d
                for _ in range(2):
                    run_waves(eng, wp, warm, b)
            # every prompt of the cells once (their prefill shapes: otherwise the first timed round
            # compiles them, measured at half the speed of the next rounds at batch 1)
            eng.spec = None
            run_waves(eng, prompt_sets[task][: max(a.num_prompts, b)], SamplingParams(temperature=0.0, max_tokens=2), b)
    log(f"warm-up {time.perf_counter() - t0:.1f} s")

    rows: list[dict[str, Any]] = []
    for task in a.tasks:
        for b in a.batch_size:
            prompts = prompt_sets[task][: max(a.num_prompts, b)]
            for temp in a.temperature:
                params = SamplingParams(temperature=temp, max_tokens=a.max_tokens, ignore_eos=a.ignore_eos,
                                        seed=None)
                base_runs: list[tuple[float, int]] = []  # (seconds, tokens) per round
                runs: dict[str, list[tuple[float, int]]] = {m: [] for m in decoders}
                spec_outs: dict[str, list] = {m: [] for m in decoders}
                base_outs: list = []
                for d in decoders.values():
                    d.metrics.reset()
                # A round runs every wave once with the baseline and once with each method, the runs
                # of one wave back to back (the order reversed every other wave): the host's speed
                # drifts within seconds (a fixed Python loop: 71-136 ms within one minute on the
                # device), so each method's sums cover the same moments as the baseline's.
                waves = [prompts[w : w + b] for w in range(0, len(prompts), b)]
                names = [None, *decoders]
                for it in range(a.num_iters):
                    acc = {m: [0.0, 0] for m in names}
                    for wi, wave in enumerate(waves):
                        order = names if (it * len(waves) + wi) % 2 == 0 else names[::-1]
                        for m in order:
                            eng.spec = None if m is None else decoders[m]
                            torch.manual_seed(a.seed + 1000 * it + wi)
                            outs, secs = run_waves(eng, wave, params, b)
                            acc[m][0] += secs
                            acc[m][1] += sum(len(o.outputs[0].token_ids) for o in outs)
                            if it == 0:
                                (base_outs if m is None else spec_outs[m]).extend(outs)
                    base_runs.append(tuple(acc[None]))
                    for m in decoders:
                        runs[m].append(tuple(acc[m]))
                base_s, base_tokens, base_tps = _median_run(base_runs)
                log(f"{task} batch {b} T={temp}: baseline {base_tps:.1f} tok/s "
                    f"(rounds: {', '.join(f'{t / s:.0f}' for s, t in base_runs)})")
                for m, d in decoders.items():
                    outs = spec_outs[m]
                    secs, toks, _ = _median_run(runs[m])
                    paired = [(t / s) / (bt / bs) for (s, t), (bs, bt) in zip(runs[m], base_runs)]
                    st = d.metrics.as_dict().get(d.name, {})
                    row = {
                        "method": m, "task": task, "batch_size": b, "temperature": temp, "num_prompts": len(prompts),
                        "spec_config": d.config.as_dict(),
                        "baseline_tokens": base_tokens, "baseline_s": base_s, "baseline_tok_s": base_tps,
                        "spec_tokens": toks, "spec_s": secs, "spec_tok_s": toks / secs,
                        # each round's own ratio (its waves ran back to back with the baseline's),
                        # then the median over rounds
                        "speedup": statistics.median(paired),
                        "speedup_rounds": paired,
                        "speedup_of_medians": (toks / secs) / base_tps,
                        "num_iters": a.num_iters,
                        "baseline_tok_s_rounds": [t / s for s, t in base_runs],
                        "spec_tok_s_rounds": [t / s for s, t in runs[m]],
                        "acceptance_rate": st.get("acceptance_rate", 0.0),
                        "mean_accepted_per_step": st.get("mean_accepted_per_step", 0.0),
                        "mean_emitted_per_step": st.get("mean_emitted_per_step", 0.0),
                        "num_verify_steps": st.get("num_steps", 0),
                        "num_no_draft": st.get("num_no_draft", 0),
                        "accepted_hist": st.get("accepted_hist", []),
                    }
                    if temp == 0.0:
                        same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(outs, base_outs))
                        row["greedy_equal"] = f"{same}/{len(outs)}"
                    if d.ctrl is not None:
                        row["controller"] = d.ctrl.as_dict()
                    rows.append(row)
                    log(f"  {m}: {row['spec_tok_s']:.1f} tok/s ({row['speedup']:.2f}x), "
                        f"accepted/step {row['mean_accepted_per_step']:.2f}, acceptance {row['acceptance_rate']:.2f}")
    eng.spec = owned

    result = {
        "benchmark": "spec",
        "model": a.model,
        "dtype": str(eng.dtype).replace("torch.", ""),
        "quantization": a.quantization,
        "kv_cache_dtype": a.kv_cache_dtype,
        "device": eng.device.type,
        "max_tokens": a.max_tokens,
        "text_tokens": a.text_tokens,
        "ignore_eos": a.ignore_eos,
        "engine_init_s": init_s,
        "medusa_path": a.medusa_path,
        "medusa_training": medusa_summary,
        "results": rows,
        "env": env_info("pageflash bench spec", argv, eng.device),
    }
    print_report(result)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {a.json}")
    del llm, eng, decoders
    gc.collect()
    return 0


def _median_run(runs: list[tuple[float, int]]) -> tuple[float, int, float]:
    """(seconds, tokens, tok/s) of the round with the median tok/s."""
    s, t = sorted(runs, key=lambda r: r[1] / r[0])[len(runs) // 2]
    return s, t, t / s


def print_report(result: dict) -> None:
    headers = ["method", "task", "B", "T", "base tok/s", "spec tok/s", "speedup", "accept", "acc/step",
               "tok/step", "greedy="]
    rows = [[r["method"], r["task"], str(r["batch_size"]), fmt(r["temperature"], ".1f"),
             fmt(r["baseline_tok_s"]), fmt(r["spec_tok_s"]), fmt(r["speedup"], ".2f") + "x",
             fmt(r["acceptance_rate"], ".2f"), fmt(r["mean_accepted_per_step"], ".2f"),
             fmt(r["mean_emitted_per_step"], ".2f"), r.get("greedy_equal", "-")]
            for r in result["results"]]
    print(f"speculative decoding, {result['model']} ({result['dtype']}, {result['device']}), "
          f"max_tokens {result['max_tokens']}, grounded text ~{result['text_tokens']} tokens")
    print(format_table(headers, rows))


if __name__ == "__main__":
    sys.exit(main())
