"""Decode latency: ``pageflash bench latency [--model llama-3-8b] [--batch-size 1 8 32] [--json F] [--plot F]``.

W-decode1 by default (docs/BENCH_USAGE.md): the llama-3-8b config with random weights, a prompt of
128 random token ids, 256 new tokens, greedy, EOS ignored, batch 1. For each batch size B, B fresh
random prompts per iteration (so the prefix cache never hits) run through the engine's step loop,
each step timed with ``time.perf_counter`` (step() returns host token ids, so it is synchronous; on
CUDA the device is synchronized only at the start and end of an iteration).

Figures per batch size (medians over the timed iterations):
- TTFT: submit -> the step that returned a request's first token (mean over the batch).
- decode tok/s: tokens after the first over the time after the first token; per sequence and total.
- step ms: wall time of each pure decode step (every sequence of the batch already has its first token).
  Those steps hold fewer than B sequences when the first requests finish before the last are prefilled
  (long prompts, chunked prefill): ``decode_seqs_mean`` in the JSON, and a note under the table.
- GB/s: bytes a decode step must read (weights except the embedding table + the K/V of every
  context, pageflash.bench.roofline) over the step time; % roofline: that over the measured copy bandwidth.
- cold start: engine construction + the first request's time to first token (first run in the process);
  the JSON also gives the whole first iteration's time (lazy graph capture would land there).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Optional, Sequence

DEFAULT_LATENCY_MODEL = "llama-3-8b"
TOKEN_ID_RANGE = 10000  # random prompt ids are drawn from [0, min(this, vocab))


# ---- shared with throughput.py ---------------------------------------------------------------------


def add_engine_args(p: argparse.ArgumentParser, default_model: str, copy_bandwidth: bool = True) -> None:
    """Engine flags with vLLM's names (unset ones, None, keep LLM's own defaults), ceilings and output."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=default_model,
                   help="named config (random weights), HF folder or .gguf file (default: %(default)s)")
    g.add_argument("--tokenizer", default=None)
    g.add_argument("--load-format", default=None, choices=["auto", "dummy", "gguf", "safetensors", "pt"],
                   help="default: dummy (random weights) for a named config, auto otherwise")
    g.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16, float32")
    g.add_argument("--device", default="auto")
    g.add_argument("--block-size", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_const", const=False,
                   default=None)
    g.add_argument("--seed", type=int, default=0, help="engine seed and random prompts' seed (default: 0)")
    g.add_argument("--attention-backend", default=None)
    g.add_argument("--quantization", "-q", default=None, choices=["int8", "fp8"],
                   help="quantization at load: int8 or fp8 (default: none)")
    g.add_argument("--kv-cache-dtype", default=None, choices=["auto", "int8", "fp8", "fp8_e4m3"],
                   help="KV cache element type (default: auto, the model's dtype)")
    g.add_argument("--enforce-eager", action="store_const", const=True, default=None,
                   help="no CUDA graphs (passed only if the engine accepts enforce_eager)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap host work with the device (default: the engine's, on for CUDA)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=None,
                   help="split the model over this many GPUs (default: 1)")
    g = p.add_argument_group("LoRA")
    g.add_argument("--enable-lora", action="store_const", const=True, default=None,
                   help="LoRA slots in the engine (decode graphs with the LoRA kernels); requests under "
                        "adapters only with --lora-rank")
    g.add_argument("--max-loras", type=int, default=None, help="device slots (default: --num-loras)")
    g.add_argument("--max-lora-rank", type=int, default=None, help="default: --lora-rank")
    g.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="run the requests under random adapters of rank R on every q/k/v/o and gate/up/down "
                        "projection (implies --enable-lora)")
    g.add_argument("--num-loras", type=int, default=1, metavar="K",
                   help="with --lora-rank: K different adapters, requests assigned in turn (default: 1)")
    g = p.add_argument_group("ceilings")
    if copy_bandwidth:
        g.add_argument("--copy-bandwidth", type=float, default=None, metavar="GBPS",
                       help="use this copy bandwidth (GB/s, read + write) instead of measuring it")
    g.add_argument("--gemm-tflops", type=float, default=None, metavar="TFLOPS",
                   help="use this GEMM TFLOP/s instead of measuring it")
    g = p.add_argument_group("output")
    g.add_argument("--json", metavar="PATH", help="write every figure to this JSON file")
    g.add_argument("--plot", metavar="PNG", help="draw the result to this image (needs matplotlib)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


ENGINE_KEYS = (
    "model", "tokenizer", "load_format", "dtype", "device", "block_size", "num_kv_blocks",
    "gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
    "enable_prefix_caching", "seed", "attention_backend", "quantization", "kv_cache_dtype", "enforce_eager", "async_scheduling",
    "tensor_parallel_size", "enable_lora", "max_loras", "max_lora_rank",
)


def lora_overrides(a: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) arguments --lora-rank implies: LoRA on, room for --num-loras adapters of that rank."""
    if a.lora_rank is None:
        return {}
    if a.lora_rank < 1 or a.num_loras < 1:
        raise ValueError(f"--lora-rank and --num-loras must be >= 1, got {a.lora_rank} and {a.num_loras}")
    return {"enable_lora": True, "max_lora_rank": max(a.lora_rank, a.max_lora_rank or 0),
            "max_loras": a.max_loras or a.num_loras}


def bench_loras(a: argparse.Namespace, cfg: Any, folder: str) -> list[Any]:
    """--num-loras random adapters of rank --lora-rank for the model of config cfg, written under folder
    (lora.adapter.write_random_adapter), as LoRARequests; [] without --lora-rank."""
    if a.lora_rank is None:
        return []
    from pageflash.lora import LoRARequest
    from pageflash.lora.adapter import write_random_adapter

    return [LoRARequest(f"bench{k}", k + 1, write_random_adapter(os.path.join(folder, f"bench{k}"), cfg,
                                                                 a.lora_rank, seed=a.seed + k))
            for k in range(a.num_loras)]


def lora_cycle(loras: list[Any], n: int) -> Optional[list[Any]]:
    """The LoRARequests of n prompts, bench_loras' adapters in turn; None without adapters."""
    return [loras[i % len(loras)] for i in range(n)] if loras else None


def resolve_load_format(model: str, load_format: Optional[str]) -> str:
    """dummy for a named config unless a format was given; auto for files and folders."""
    if load_format is not None:
        return load_format
    from pageflash.model.registry import NAMED_CONFIGS

    return "dummy" if model.lower() in NAMED_CONFIGS else "auto"


def llm_kwargs(a: argparse.Namespace, overrides: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Keyword arguments for LLM(...): the flags the user set, minus any LLM does not accept (warned)."""
    from pageflash.llm import LLM

    accepted = inspect.signature(LLM.__init__).parameters
    kw: dict[str, Any] = {}
    for key in ENGINE_KEYS:
        v = getattr(a, key, None)
        if key == "load_format":
            v = resolve_load_format(a.model, v)
        if v is None:
            continue
        if key not in accepted:
            warnings.warn(f"LLM does not accept {key}={v!r}; ignoring it", stacklevel=2)
            continue
        kw[key] = v
    for key, v in (overrides or {}).items():
        if key in accepted:
            kw[key] = v
    return kw


def llm_default(name: str) -> Any:
    from pageflash.llm import LLM

    return inspect.signature(LLM.__init__).parameters[name].default


def check_plot_available(path: Optional[str]) -> Optional[str]:
    """An error message when --plot was asked for but matplotlib is missing (checked before the run)."""
    if not path:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install matplotlib (or pip install -e '.[dev]')"
    return None


def env_info(prog: str, argv: Sequence[str], device: Any) -> dict[str, Any]:
    """What a BENCHMARKS.md entry needs: command, commit, device, versions, date."""
    import torch

    from pageflash.bench.roofline import device_name

    info: dict[str, Any] = {
        "command": f"{prog} {shlex.join(list(argv))}".strip(),
        "device": str(device),
        "device_name": device_name(device),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception:
        info["triton"] = None
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        info["commit"] = rev.stdout.strip() or None
        info["dirty"] = bool(dirty.stdout.strip()) if rev.returncode == 0 else None
    except Exception:
        info["commit"], info["dirty"] = None, None
    return info


def sync(device: Any) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda" or str(device).startswith("cuda"):
        torch.cuda.synchronize(device)


def dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def dtype_label(result: dict[str, Any]) -> str:
    """The model's dtype, "+int8" for quantized weights, "/kv:int8" for a quantized KV cache, "/tp2" for
    two tensor-parallel ranks, "/lora" with LoRA slots and no adapter, "/lora16x2" under two rank-16
    adapters."""
    label = result["dtype"]
    if result.get("quantization"):
        label += f"+{result['quantization']}"
    if result.get("kv_cache_dtype") not in (None, "auto"):
        label += f"/kv:{result['kv_cache_dtype']}"
    if (result.get("tensor_parallel_size") or 1) > 1:
        label += f"/tp{result['tensor_parallel_size']}"
    lora = result.get("lora") or {}
    if lora.get("enabled"):
        label += f"/lora{lora['rank']}x{lora['adapters']}" if lora.get("adapters") else "/lora"
    return label


def kv_elem_bytes(eng: Any) -> float:
    """Cache bytes per K/V element (ModelRunner.kv_bytes_per_block's, which counts a quantized
    cache's scales) per element of a block."""
    runner = getattr(eng, "runner", None)
    kv = getattr(runner, "kv_cache", None)
    if kv is None:
        return eng.dtype.itemsize
    return runner.kv_bytes_per_block() / (kv[:, :, 0].numel())


def fmt(v: Any, spec: str = ".1f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (q in [0, 100]); None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median_of(rows: list[dict[str, Any]], key: str) -> Optional[float]:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def write_json(path: str, result: dict[str, Any]) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")


# ---- one iteration -----------------------------------------------------------------------------


def random_prompts(rng: random.Random, batch: int, input_len: int, vocab_size: int) -> list[list[int]]:
    hi = min(TOKEN_ID_RANGE, vocab_size)
    return [[rng.randrange(hi) for _ in range(input_len)] for _ in range(batch)]


def run_iteration(eng: Any, prompts: list[list[int]], output_len: int, *, roof: dict[str, Any],
                  loras: Sequence[Any] = ()) -> dict[str, Any]:
    """Submit the prompts at once, step until all finish, time every step.

    roof: {"cfg": ModelConfig, "weight_bytes_per_param": int, "kv_bytes_per_elem": int}. loras:
    LoRARequests the prompts run under in turn (none: the base model).
    Returns per-iteration figures (times in ms or s as named; None where there was no decode step).
    """
    from pageflash.bench.roofline import decode_step_bytes, decode_step_flops
    from pageflash.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    dev = eng.device
    sync(dev)
    t0 = time.perf_counter()
    per_prompt = lora_cycle(loras, len(prompts)) or [None] * len(prompts)
    rids = [eng.add_request(None, {"prompt_token_ids": p}, params, lora_request=lr)
            for p, lr in zip(prompts, per_prompt)]
    n_prompt = {rid: len(p) for rid, p in zip(rids, prompts)}
    count = {rid: 0 for rid in rids}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    pending = set(rids)
    step_ms: list[float] = []  # pure decode steps only
    step_seqs: list[int] = []  # sequences in each of them (fewer than the batch once some finished)
    step_bytes: list[int] = []
    step_flops = 0.0
    decode_tokens = 0
    n_steps = 0
    t_prev = t0
    try:
        while pending:
            decoding = len(first) == len(rids)  # every sequence has its first token: a pure decode step
            # keys each sequence's next token attends to: prompt + generated so far (its own input included)
            ctx = [n_prompt[r] + count[r] for r in pending] if decoding else []
            outs = eng.step()
            t = time.perf_counter()
            n_steps += 1
            new = 0
            for o in outs:
                rid = o.request_id
                if rid not in count:
                    continue
                c = len(o.outputs[0].token_ids)
                new += c - count[rid]
                count[rid] = c
                if c > 0 and rid not in first:
                    first[rid] = t
                if o.finished:
                    done[rid] = t
                    pending.discard(rid)
            if decoding:
                step_ms.append((t - t_prev) * 1e3)
                step_seqs.append(len(ctx))
                step_bytes.append(decode_step_bytes(roof["cfg"], ctx, roof["weight_bytes_per_param"],
                                                    roof["kv_bytes_per_elem"]))
                step_flops += decode_step_flops(roof["cfg"], ctx)
                decode_tokens += new
            t_prev = t
            if n_steps > 10 * (output_len + sum(n_prompt.values())) + 100:
                raise RuntimeError("the engine stopped making progress")
    except BaseException:
        eng.abort_request(list(pending))
        raise
    sync(dev)
    t_end = time.perf_counter()
    ttfts = [(first[r] - t0) * 1e3 for r in rids]
    per_seq = [(count[r] - 1) / (done[r] - first[r]) for r in rids if count[r] > 1 and done[r] > first[r]]
    decode_s = sum(step_ms) / 1e3
    total_bytes = sum(step_bytes)
    return {
        "batch_size": len(prompts),
        "latency_s": t_end - t0,
        "ttft_ms": statistics.mean(ttfts),
        "ttft_ms_max": max(ttfts),
        "num_steps": n_steps,
        "decode_steps": len(step_ms),
        "decode_tokens": decode_tokens,
        "decode_tok_s_per_seq": statistics.mean(per_seq) if per_seq else None,
        "decode_tok_s_total": decode_tokens / decode_s if decode_s > 0 else None,
        "decode_seqs_mean": statistics.mean(step_seqs) if step_seqs else None,
        "step_ms_mean": statistics.mean(step_ms) if step_ms else None,
        "step_ms_median": statistics.median(step_ms) if step_ms else None,
        "step_ms_p90": percentile(step_ms, 90),
        "step_ms_p99": percentile(step_ms, 99),
        "bytes_per_step_mean": total_bytes / len(step_bytes) if step_bytes else None,
        "achieved_gbps": total_bytes / decode_s / 1e9 if decode_s > 0 else None,
        "achieved_tflops": step_flops / decode_s / 1e12 if decode_s > 0 else None,
        "_decode_s": decode_s,
        "_total_bytes": total_bytes,
        "_first_ttft_ms": ttfts[0],
    }


def summarize(iters: list[dict[str, Any]], copy_gbps: float, gemm_tflops: Optional[float]) -> dict[str, Any]:
    """Medians over the timed iterations, plus % roofline, the roofline tok/s and % of the GEMM ceiling."""
    out: dict[str, Any] = {"batch_size": iters[0]["batch_size"]}
    for key in ("ttft_ms", "ttft_ms_max", "decode_tok_s_per_seq", "decode_tok_s_total", "decode_seqs_mean",
                "step_ms_mean", "step_ms_median", "step_ms_p90", "step_ms_p99", "bytes_per_step_mean", "achieved_gbps",
                "achieved_tflops"):
        out[key] = median_of(iters, key)
    lat = [r["latency_s"] for r in iters]
    out["latency_s_avg"] = statistics.mean(lat)
    out["latency_s_p50"] = percentile(lat, 50)
    out["latency_s_p90"] = percentile(lat, 90)
    out["latency_s_p99"] = percentile(lat, 99)
    bw = out["achieved_gbps"]
    out["roofline_pct"] = 100.0 * bw / copy_gbps if bw is not None and copy_gbps else None
    # decode tok/s (total) if every step ran at the copy bandwidth
    b = out["bytes_per_step_mean"]
    out["roofline_tok_s_total"] = copy_gbps * 1e9 / b * out["batch_size"] if b else None
    tf = out["achieved_tflops"]
    out["compute_pct"] = 100.0 * tf / gemm_tflops if tf is not None and gemm_tflops else None
    out["iterations"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in iters]
    return out


# ---- report ------------------------------------------------------------------------------------------


def print_report(result: dict[str, Any], file=None) -> None:
    file = sys.stdout if file is None else file
    rows = []
    for r in result["results"]:
        rows.append([
            result["model"], dtype_label(result), result["device"], str(r["batch_size"]), fmt(r["ttft_ms"]),
            fmt(r["decode_tok_s_per_seq"]), fmt(r["decode_tok_s_total"]), fmt(r["step_ms_median"], ".2f"),
            fmt(r["achieved_gbps"]), fmt(r["roofline_pct"]), fmt(r["roofline_tok_s_total"]),
            fmt(r["compute_pct"], ".2f"),
        ])
    headers = ["model", "dtype", "device", "batch", "TTFT ms", "tok/s/seq", "tok/s total", "step ms",
               "GB/s", "% roofline", "roofline tok/s", "% compute"]
    cs = result["cold_start"]
    print(file=file)
    print(f"== pageflash bench latency: {result['model']} ({result['load_format']}), input {result['input_len']}, "
          f"output {result['output_len']}, {result['num_iters']} iters, {result['env']['device_name']}", file=file)
    print(f"copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s ({result['copy_bandwidth_source']}); "
          f"weights read per step {result['weight_bytes'] / 1e9:.3f} GB"
          f"{' (all experts; each batch size reads its expected share)' if result.get('moe') else ''}; "
          f"cold start {cs['total_s']:.2f} s (engine {cs['engine_init_s']:.2f} s + first token "
          f"{cs['first_token_s'] * 1e3:.0f} ms)"
          + (f"; GEMM {result['gemm_tflops']:.0f} TFLOP/s ({result['gemm_tflops_source']})"
             if result.get("gemm_tflops") else ""), file=file)
    print(format_table(headers, rows), file=file)
    for r in result["results"]:
        n = r.get("decode_seqs_mean")
        if n is not None and n < r["batch_size"] - 0.05:
            print(f"note: batch {r['batch_size']}: its decode steps held {n:.1f} sequences on average, not "
                  f"{r['batch_size']} (the first requests finished before the last were prefilled); "
                  f"tok/s total, step ms and GB/s are over those steps", file=file)


def plot(result: dict[str, Any], path: str) -> None:
    """tok/s (total and per sequence) and % roofline against batch size."""
    from matplotlib.figure import Figure

    rs = result["results"]
    bs = [r["batch_size"] for r in rs]
    fig = Figure(figsize=(7, 4.5), dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    tot = [r["decode_tok_s_total"] or 0.0 for r in rs]
    seq = [r["decode_tok_s_per_seq"] or 0.0 for r in rs]
    ax.plot(bs, tot, "o-", color="tab:blue", label="decode tok/s (total)")
    ax.plot(bs, seq, "s--", color="tab:cyan", label="decode tok/s (per sequence)")
    roof = [r["roofline_tok_s_total"] for r in rs]
    if all(v is not None for v in roof):
        ax.plot(bs, roof, ":", color="gray", label="roofline tok/s (copy bandwidth)")
    if len(bs) > 1:
        ax.set_xscale("log", base=2)
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size")
    ax.set_ylabel("tokens / s")
    ax2 = ax.twinx()
    pct = [r["roofline_pct"] or 0.0 for r in rs]
    ax2.plot(bs, pct, "^-", color="tab:red", label="% of roofline")
    ax2.set_ylabel("% of copy-bandwidth roofline", color="tab:red")
    ax2.set_ylim(0, max(100.0, max(pct) * 1.1))
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=8)
    ax.set_title(f"{result['model']} {result['dtype']} on {result['env']['device_name']}\n"
                 f"input {result['input_len']}, output {result['output_len']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


# ---- main ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pageflash bench latency", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="one or more (a sweep), e.g. 1 8 32")
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--num-iters", type=int, default=3)
    add_engine_args(p, DEFAULT_LATENCY_MODEL)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    for name in ("input_len", "output_len", "num_iters"):
        if getattr(a, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}", file=sys.stderr)
            return 2
    if a.num_iters_warmup < 0 or any(b < 1 for b in a.batch_size):
        print("error: --num-iters-warmup must be >= 0 and every --batch-size >= 1", file=sys.stderr)
        return 2
    err = check_plot_available(a.plot)
    if err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        return _run(a, argv)
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run(a: argparse.Namespace, argv: list[str]) -> int:
    from tqdm.auto import tqdm

    from pageflash.bench import roofline
    from pageflash.llm import LLM

    overrides = {}
    max_b = max(a.batch_size)
    if a.max_num_seqs is None and max_b > llm_default("max_num_seqs"):
        overrides["max_num_seqs"] = max_b
    kwargs = llm_kwargs(a, {**overrides, **lora_overrides(a)})

    # Cold start: engine construction (CUDA init, weights, KV cache, any graph capture) + first token.
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    engine_init_s = time.perf_counter() - t0
    eng = llm.llm_engine
    # the roofline of one rank's work: with tensor parallelism rank 0's shard (its heads, KV heads and
    # MLP slice, and the whole LM head), which the ranks' GPUs run at once (all-reduces not counted)
    cfg = eng.runner.cfg
    # bytes per parameter as the model holds its weights (2 in bf16; less with quantization)
    wpp = roofline.step_weight_bytes(eng.runner.model) / roofline.matmul_params(cfg)
    roof = {"cfg": cfg, "weight_bytes_per_param": wpp, "kv_bytes_per_elem": kv_elem_bytes(eng)}
    rng = random.Random(a.seed)
    lora_dir = tempfile.TemporaryDirectory(prefix="pageflash-bench-lora-")
    loras = bench_loras(a, cfg, lora_dir.name)

    results = []
    first_token_s: Optional[float] = None
    first_iter_s: Optional[float] = None
    for b in a.batch_size:
        warm = tqdm(range(a.num_iters_warmup), desc=f"Warmup (batch {b})", disable=a.disable_tqdm, leave=False)
        for _ in warm:
            r = run_iteration(eng, random_prompts(rng, b, a.input_len, cfg.vocab_size), a.output_len, roof=roof, loras=loras)
            if first_token_s is None:
                first_token_s, first_iter_s = r["_first_ttft_ms"] / 1e3, r["latency_s"]
        iters = []
        for _ in tqdm(range(a.num_iters), desc=f"Profiling iterations (batch {b})", disable=a.disable_tqdm):
            r = run_iteration(eng, random_prompts(rng, b, a.input_len, cfg.vocab_size), a.output_len, roof=roof, loras=loras)
            if first_token_s is None:
                first_token_s, first_iter_s = r["_first_ttft_ms"] / 1e3, r["latency_s"]
            iters.append(r)
        results.append(iters)

    # Ceilings after the cold start, so that it includes CUDA initialization.
    copy_source = "given" if a.copy_bandwidth else "measured"
    copy_gbps = a.copy_bandwidth or roofline.measure_copy_bandwidth(eng.device)
    gemm, gemm_source = a.gemm_tflops, "given"
    if gemm is None and eng.device.type == "cuda":
        gemm, gemm_source = roofline.measure_gemm_tflops(eng.device), "measured"
    if gemm is None:
        gemm_source = None

    result: dict[str, Any] = {
        "benchmark": "latency",
        "model": a.model,
        "load_format": kwargs.get("load_format"),
        "dtype": dtype_name(eng.dtype),
        "quantization": kwargs.get("quantization"),
        "kv_cache_dtype": kwargs.get("kv_cache_dtype") or "auto",
        "tensor_parallel_size": kwargs.get("tensor_parallel_size") or 1,
        "lora": {"enabled": bool(kwargs.get("enable_lora")), "rank": a.lora_rank, "adapters": len(loras)},
        "device": eng.device.type,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "num_iters_warmup": a.num_iters_warmup,
        "num_iters": a.num_iters,
        "copy_bandwidth_gbps": copy_gbps,
        "copy_bandwidth_source": copy_source,
        "gemm_tflops": gemm,
        "gemm_tflops_source": gemm_source,
        "weight_bytes": roofline.weight_bytes(cfg, roof["weight_bytes_per_param"]),
        "moe": bool(cfg.num_experts),
        "kv_bytes_per_token": roofline.kv_bytes_per_token(cfg, roof["kv_bytes_per_elem"]),
        "cold_start": {
            "engine_init_s": engine_init_s,
            "first_token_s": first_token_s,
            "total_s": engine_init_s + first_token_s,
            # the whole first iteration too: catches work an engine defers past the first token
            # (e.g. CUDA graphs captured lazily at the first decode steps)
            "first_iteration_s": first_iter_s,
        },
        "results": [summarize(iters, copy_gbps, gemm) for iters in results],
        "engine_kwargs": kwargs,
        "env": env_info("pageflash bench latency", argv, eng.device),
    }
    print_report(result)
    if a.json:
        write_json(a.json, result)
        print(f"wrote {a.json}")
    if a.plot:
        plot(result, a.plot)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
