"""Micro-benchmark of the fused elementwise kernels against the PyTorch paths they replace.

    python -m pageflash.kernels.bench_fused [--tokens 1 4096] [--json out.json] [--sweep]

llama-3-8b sizes, bf16: H 4096, 32 query / 8 KV heads of 128, I 14336. For each op and T:
- ``graph``: µs per call as CUDA-graph replays (``triton.testing.do_bench_cudagraph``, median), the
  decode setting, where launch overheads are gone but every kernel still costs its ~2 µs minimum;
- ``eager``: µs per call from ``triton.testing.do_bench`` (median, L2 flushed), the prefill setting;
- GB/s of the fused kernel (bytes it must move / graph time).
``--sweep`` also times rms_norm with 4/8/16 warps. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

import torch

H, HQ, HKV, D, INTER, EPS = 4096, 32, 8, 128, 14336, 1e-5


def _us(fn: Callable[[], object], graph: bool) -> float:
    import triton.testing

    if graph:
        return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def cases(t: int, dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, Callable, Callable, int]]:
    """(name, pytorch path, fused kernel, bytes the fused kernel moves) for T tokens."""
    from pageflash.config import ModelConfig
    from pageflash.kernels.activation import silu_and_mul, silu_and_mul_ref
    from pageflash.kernels.rms_norm import rms_norm, rms_norm_fused_ref, rms_norm_ref
    from pageflash.kernels.rotary import apply_rotary, apply_rotary_ref
    from pageflash.layers.rotary import RotaryEmbedding

    dev, es = "cuda", torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(t, H, device=dev).to(dtype)
    r = torch.randn(t, H, device=dev).to(dtype)
    w = torch.randn(H, device=dev).to(dtype)
    cfg = ModelConfig(vocab_size=128256, hidden_size=H, intermediate_size=INTER, num_hidden_layers=32,
                      num_attention_heads=HQ, num_key_value_heads=HKV, head_dim=D, rope_theta=500000.0)
    rope = RotaryEmbedding(cfg, 8192).to(dev)
    qkv = torch.randn(t, (HQ + 2 * HKV) * D, device=dev).to(dtype)
    q, k, _ = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k = q.view(t, HQ, D), k.view(t, HKV, D)
    pos = torch.randint(0, 8192, (t,), device=dev)
    gu = torch.randn(t, 2 * INTER, device=dev).to(dtype)
    return [
        ("rms_norm", lambda: rms_norm_ref(x, w, EPS), lambda: rms_norm(x, w, EPS), (2 * t * H + H) * es),
        ("add+rms_norm", lambda: rms_norm_fused_ref(x, w, EPS, r), lambda: rms_norm(x, w, EPS, r),
         (4 * t * H + H) * es),
        ("rotary q+k", lambda: apply_rotary_ref(q, k, pos, rope.cos, rope.sin),
         lambda: apply_rotary(q, k, pos, rope.cos, rope.sin), 2 * t * (HQ + HKV) * D * es + t * (8 + 4 * D)),
        ("silu_and_mul", lambda: silu_and_mul_ref(gu), lambda: silu_and_mul(gu), 3 * t * INTER * es),
    ]


def run(tokens: list[int], sweep: bool = False) -> list[dict]:
    from pageflash.kernels.rms_norm import rms_norm

    rows = []
    for t in tokens:
        for name, ref, fused, nbytes in cases(t):
            row = {"op": name, "T": t}
            for mode in ("graph", "eager"):
                row[f"torch_{mode}_us"] = _us(ref, mode == "graph")
                row[f"fused_{mode}_us"] = _us(fused, mode == "graph")
            row["fused_GBps"] = nbytes / row["fused_graph_us"] / 1e3
            rows.append(row)
        if sweep:
            x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
            r, w = torch.randn_like(x), torch.randn(H, device="cuda", dtype=torch.bfloat16)
            for nw in (4, 8, 16):
                us = _us(lambda: rms_norm(x, w, EPS, r, num_warps=nw), graph=True)
                rows.append({"op": f"add+rms_norm num_warps={nw}", "T": t, "fused_graph_us": us})
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pageflash.kernels.bench_fused", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4096])
    ap.add_argument("--sweep", action="store_true", help="also time rms_norm with 4/8/16 warps")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fused needs CUDA", file=sys.stderr)
        return 2
    import triton

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, bf16, "
          f"H {H}, heads {HQ}/{HKV}x{D}, I {INTER}")
    rows = run(args.tokens, args.sweep)
    hdr = f"{'op':<28}{'T':>6}  {'torch graph':>11} {'fused graph':>11} {'speedup':>7}  {'torch eager':>11} {'fused eager':>11}  {'GB/s':>6}"
    print(hdr + "\n" + "-" * len(hdr))
    for r in rows:
        if "torch_graph_us" not in r:
            print(f"{r['op']:<28}{r['T']:>6}  {'':>11} {r['fused_graph_us']:>11.2f}")
            continue
        print(f"{r['op']:<28}{r['T']:>6}  {r['torch_graph_us']:>11.2f} {r['fused_graph_us']:>11.2f} "
              f"{r['torch_graph_us'] / r['fused_graph_us']:>6.1f}x  {r['torch_eager_us']:>11.2f} "
              f"{r['fused_eager_us']:>11.2f}  {r['fused_GBps']:>6.0f}")
    print("(µs per call; graph = CUDA-graph replay, eager = do_bench with L2 flush)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
