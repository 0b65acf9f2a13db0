"""Offline throughput: ``pageflash bench throughput [--model smollm2-135m] [--num-prompts 256] [--json F] [--plot F]``.

W-offline by default (docs/BENCH_USAGE.md): 256 requests, prompt lengths uniform in [100, 1024] of
random token ids in [0, 10000) (seed 0, see ``w_offline_requests``), 512 new tokens each, greedy, EOS
ignored, all submitted at once through ``LLM.generate``. Wall time covers the whole generate() call
(prefill included); engine construction and a short warmup run come before it and are reported apart.

Figures: output tok/s (the W-offline metric), total tok/s (prompt + output), requests/s, wall time,
TTFT over the requests, and the run's forward FLOPs (pageflash.bench.roofline.sequence_flops) over
the wall time against a measured bf16 GEMM TFLOP/s (the compute ceiling; CUDA only).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

from pageflash.bench.latency import (
    add_engine_args,
    bench_loras,
    lora_cycle,
    check_plot_available,
    dtype_label,
    dtype_name,
    env_info,
    fmt,
    format_table,
    llm_kwargs,
    lora_overrides,
    percentile,
    sync,
    write_json,
)

DEFAULT_THROUGHPUT_MODEL = "smollm2-135m"


def w_offline_requests(
    num_prompts: int = 256,
    input_len_range: tuple[int, int] = (100, 1024),
    output_len: int = 512,
    max_token_id: int = 10000,
    seed: int = 0,
    input_len: Optional[int] = None,
) -> list[tuple[list[int], int]]:
    """The W-offline requests: (prompt token ids, output length) pairs.

    One ``random.Random(seed)`` stream; per request, its length (``randint(lo, hi)``, both ends
    included, unless input_len fixes it), then its ids (``randrange(max_token_id)`` each). A peer
    script can import this to run the very same prompts.
    """
    lo, hi = input_len_range
    if input_len is None and not (1 <= lo <= hi):
        raise ValueError(f"input length range must satisfy 1 <= lo <= hi, got [{lo}, {hi}]")
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_prompts):
        n = input_len if input_len is not None else rng.randint(lo, hi)
        reqs.append(([rng.randrange(max_token_id) for _ in range(n)], output_len))
    return reqs


def load_dataset(path: str, default_output_len: int, limit: Optional[int]) -> list[tuple[Any, int]]:
    """JSONL rows: {"prompt_token_ids": [...]} or {"prompt": "..."}, optional "output_len" or "max_tokens"."""
    rows: list[tuple[Any, int]] = []
    with open(path) as f:
        for ln, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not JSON ({e})") from e
            if isinstance(r, str):
                r = {"prompt": r}
            if not isinstance(r, dict) or not ("prompt_token_ids" in r or "prompt" in r):
                raise ValueError(f"{path}:{ln}: a row needs 'prompt_token_ids' or 'prompt'")
            prompt = {"prompt_token_ids": r["prompt_token_ids"]} if "prompt_token_ids" in r else r["prompt"]
            out = int(r.get("output_len", r.get("max_tokens", default_output_len)))
            rows.append((prompt, out))
            if limit is not None and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


_CUMULATIVE_SUFFIXES = ("_tokens_total", "_hits", "_queries", "num_preemptions")


def run_stats(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Engine stats after the timed run, with cumulative counters taken as deltas over the run."""
    out = {}
    for k, v in after.items():
        b = before.get(k)
        cumulative = k.endswith(_CUMULATIVE_SUFFIXES)
        if cumulative and isinstance(v, (int, float)) and isinstance(b, (int, float)) and not isinstance(v, bool):
            v = v - b
        out[k] = v
    return out


def kv_blocks(eng: Any) -> Optional[int]:
    """Blocks in the engine's KV pool (None when it has none to tell)."""
    kv = getattr(getattr(eng, "runner", None), "kv_cache", None)
    return int(kv.shape[2]) if kv is not None else None


def print_report(result: dict[str, Any], file=None) -> None:
    file = sys.stdout if file is None else file
    headers = ["model", "dtype", "device", "prompts", "in tok", "out tok", "wall s", "req/s", "TTFT ms",
               "out tok/s", "total tok/s", "TFLOP/s", "% compute"]
    row = [
        result["model"], dtype_label(result), result["device"], str(result["num_prompts"]),
        str(result["prompt_tokens"]), str(result["output_tokens"]), fmt(result["wall_s"], ".2f"),
        fmt(result["requests_per_s"], ".2f"), fmt(result["ttft_ms_mean"]), fmt(result["output_tok_s"]),
        fmt(result["total_tok_s"]), fmt(result["achieved_tflops"], ".2f"), fmt(result["compute_ceiling_pct"]),
    ]
    print(file=file)
    print(f"== pageflash bench throughput: {result['model']} ({result['load_format']}), {result['workload']}, "
          f"{result['env']['device_name']}", file=file)
    ceil = result["gemm_tflops"]
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tok_s']:.2f} total tokens/s, "
          f"{result['output_tok_s']:.2f} output tokens/s; engine init {result['engine_init_s']:.2f} s; "
          f"{result['run_flops'] / 1e12:.3g} TFLOP in the run"
          + (f"; GEMM ceiling {ceil:.0f} TFLOP/s ({result['gemm_tflops_source']}) -> "
             f"{result['ceiling_output_tok_s']:.0f} output tok/s at 100%" if ceil else ""), file=file)
    print(format_table(headers, [row]), file=file)


def plot(result: dict[str, Any], timeline: list[tuple[float, float, float, int]], path: str) -> None:
    """Left: each request's life (queued -> first token -> finished). Right: output tokens finished over time."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), dpi=120)
    ax, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    order = sorted(range(len(timeline)), key=lambda i: timeline[i][2])
    for y, i in enumerate(order):
        arr, ftok, fin, _ = timeline[i]
        ax.plot([arr, ftok], [y, y], color="tab:orange", lw=1)
        ax.plot([ftok, fin], [y, y], color="tab:blue", lw=1)
    ax.plot([], [], color="tab:orange", label="waiting + prefill (to first token)")
    ax.plot([], [], color="tab:blue", label="decode")
    ax.set_xlabel("seconds since submit")
    ax.set_ylabel("request (by finish time)")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("request timeline", fontsize=9)
    fins = sorted((t[2], t[3]) for t in timeline)
    xs, ys, acc = [0.0], [0], 0
    for t, n in fins:
        acc += n
        xs.append(t)
        ys.append(acc)
    ax2.step(xs, ys, where="post", color="tab:blue", label="output tokens of finished requests")
    wall = result["wall_s"]
    ax2.plot([0, wall], [0, result["output_tokens"]], ":", color="gray",
             label=f"mean {result['output_tok_s']:.0f} output tok/s")
    ax2.set_xlabel("seconds since submit")
    ax2.set_ylabel("tokens")
    ax2.legend(fontsize=8, loc="upper left")
    pct = result["compute_ceiling_pct"]
    ax2.set_title(f"{result['output_tok_s']:.0f} out tok/s, {result['total_tok_s']:.0f} total tok/s"
                  + (f", {pct:.1f}% of GEMM ceiling" if pct is not None else ""), fontsize=9)
    fig.suptitle(f"{result['model']} {result['dtype']} on {result['env']['device_name']}: {result['workload']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pageflash bench throughput", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=None, help="fixed prompt length (default: uniform range)")
    p.add_argument("--input-len-range", type=int, nargs=2, default=[100, 1024], metavar=("LO", "HI"),
                   help="prompt lengths uniform in [LO, HI] (default: 100 1024)")
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--max-token-id", type=int, default=10000, help="random ids in [0, this) (default: 10000)")
    p.add_argument("--dataset", metavar="JSONL", default=None,
                   help="requests from a file: {'prompt_token_ids'|'prompt', 'output_len'?} per line")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the short untimed run before the timed one")
    add_engine_args(p, DEFAULT_THROUGHPUT_MODEL, copy_bandwidth=False)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    for name in ("num_prompts", "output_len", "max_token_id"):
        if getattr(a, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}", file=sys.stderr)
            return 2
    if a.input_len is not None and a.input_len < 1:
        print(f"error: --input-len must be at least 1, got {a.input_len}", file=sys.stderr)
        return 2
    err = check_plot_available(a.plot)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        return _run(a, argv)
    except (ValueError, TypeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace, argv: list[str]) -> int:
    from pageflash.bench import roofline
    from pageflash.llm import LLM
    from pageflash.sampling_params import SamplingParams

    kwargs = llm_kwargs(a, lora_overrides(a))
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    engine_init_s = time.perf_counter() - t0
    eng = llm.llm_engine
    cfg = eng.runner.cfg  # one rank's shard under tensor parallelism: FLOP/s per GPU
    lora_dir = tempfile.TemporaryDirectory(prefix="pageflash-bench-lora-")
    loras = bench_loras(a, cfg, lora_dir.name)

    if a.dataset:
        reqs = load_dataset(a.dataset, a.output_len, a.num_prompts)
        workload = f"{len(reqs)} requests from {a.dataset}"
    else:
        max_id = min(a.max_token_id, cfg.vocab_size)
        reqs = [({"prompt_token_ids": ids}, m) for ids, m in w_offline_requests(
            a.num_prompts, tuple(a.input_len_range), a.output_len, max_id, a.seed, a.input_len)]
        lens = f"{a.input_len}" if a.input_len is not None else f"U[{a.input_len_range[0]}, {a.input_len_range[1]}]"
        workload = f"{len(reqs)} requests, input {lens} ids < {max_id}, output {a.output_len}"
        if (a.num_prompts, a.input_len, tuple(a.input_len_range), a.output_len, a.max_token_id, a.seed) == (
                256, None, (100, 1024), 512, 10000, 0):
            workload = f"W-offline ({workload})"

    def params(m: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)

    if a.warmup:  # untimed: first-call compilation and autotuning, prompt lengths of the real run
        rng = random.Random(a.seed + 1)
        # enough prompt tokens for two full steps, so that chunked prefill and steps mixing prefill
        # chunks with decodes (kernel variants of their own) compile here, not in the timed run
        lens = [len(p["prompt_token_ids"]) if isinstance(p, dict) else 32 for p, _ in reqs]
        k = 0
        while k < len(lens) and (k < 8 or sum(lens[:k]) <= 2 * eng.max_num_batched_tokens):
            k += 1
        wl = lens[:k]
        hi = min(a.max_token_id, cfg.vocab_size)
        wp = [{"prompt_token_ids": [rng.randrange(hi) for _ in range(n)]} for n in wl]
        llm.generate(wp, [params(min(4, m)) for _, m in reqs[:k]], use_tqdm=False,
                     lora_request=lora_cycle(loras, k))

    stats_before = eng.get_stats()
    prompts = [p for p, _ in reqs]
    plist = [params(m) for _, m in reqs]
    sync(eng.device)
    t_start = time.perf_counter()
    outs = llm.generate(prompts, plist, use_tqdm=not a.disable_tqdm,
                        lora_request=lora_cycle(loras, len(prompts)))
    sync(eng.device)
    wall = time.perf_counter() - t_start

    n_in = [len(o.prompt_token_ids) for o in outs]
    n_out = [sum(len(c.token_ids) for c in o.outputs) for o in outs]
    prompt_tokens, output_tokens = sum(n_in), sum(n_out)
    run_flops = sum(roofline.sequence_flops(cfg, n, m) for n, m in zip(n_in, n_out))
    achieved_tflops = run_flops / wall / 1e12

    gemm, gemm_source = a.gemm_tflops, "given"
    if gemm is None and eng.device.type == "cuda":
        gemm, gemm_source = roofline.measure_gemm_tflops(eng.device), "measured"
    if gemm is None:
        gemm_source = None

    ttft = []
    timeline = []  # (submit -> first token, submit -> finished, output tokens), seconds since the first arrival
    base = min(o.metrics.arrival_time for o in outs if o.metrics is not None) if outs and outs[0].metrics else None
    for o, m in zip(outs, n_out):
        mt = o.metrics
        if mt is None or mt.first_token_time is None:
            continue
        ttft.append((mt.first_token_time - mt.arrival_time) * 1e3)
        if base is not None and mt.finished_time is not None:
            timeline.append((mt.arrival_time - base, mt.first_token_time - base, mt.finished_time - base, m))

    result: dict[str, Any] = {
        "benchmark": "throughput",
        "model": a.model,
        "load_format": kwargs.get("load_format"),
        "dtype": dtype_name(eng.dtype),
        "quantization": kwargs.get("quantization"),
        "kv_cache_dtype": kwargs.get("kv_cache_dtype") or "auto",
        "tensor_parallel_size": kwargs.get("tensor_parallel_size") or 1,
        "lora": {"enabled": bool(kwargs.get("enable_lora")), "rank": a.lora_rank, "adapters": len(loras)},
        "kv_cache_blocks": kv_blocks(eng),
        "device": eng.device.type,
        "workload": workload,
        "num_prompts": len(outs),
        "input_len": a.input_len,
        "input_len_range": None if (a.dataset or a.input_len is not None) else list(a.input_len_range),
        "output_len": a.output_len,
        "dataset": a.dataset,
        "warmup": a.warmup,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_s": wall,
        "requests_per_s": len(outs) / wall,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (prompt_tokens + output_tokens) / wall,
        "ttft_ms_mean": statistics.mean(ttft) if ttft else None,
        "ttft_ms_median": statistics.median(ttft) if ttft else None,
        "ttft_ms_p99": percentile(ttft, 99),
        "run_flops": run_flops,
        "flops_per_token": run_flops / max(1, prompt_tokens + output_tokens),
        "achieved_tflops": achieved_tflops,
        "gemm_tflops": gemm,
        "gemm_tflops_source": gemm_source,
        # fraction of the GEMM ceiling the whole run sustained; and the output tok/s it would allow
        "compute_ceiling_pct": 100.0 * achieved_tflops / gemm if gemm else None,
        "ceiling_output_tok_s": output_tokens * gemm * 1e12 / run_flops if gemm and run_flops else None,
        "engine_init_s": engine_init_s,
        "engine_stats": run_stats(stats_before, eng.get_stats()),
        "engine_kwargs": kwargs,
        "env": env_info("pageflash bench throughput", argv, eng.device),
    }
    print_report(result)
    if a.json:
        result_json = dict(result)
        result_json["engine_stats"] = json.loads(json.dumps(result["engine_stats"], default=str))
        write_json(a.json, result_json)
        print(f"wrote {a.json}")
    if a.plot:
        plot(result, timeline, a.plot)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
