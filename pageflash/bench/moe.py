"""`pageflash bench kernels --moe`: the fused MoE kernels (kernels/fused_moe.py) at real MoE layer
shapes per token count, against the expert-by-expert reference, the roofline and transformers' experts.

Per (model layer, T): bf16 error against experts_ref in float32; time of one whole routed_moe (routing
and grouping + two grouped GEMMs + SiLU + the k-sum: the MoE block after the router's GEMM) replayed
from a CUDA graph (and fused_moe over given routing, whose grouping is torch ops); bytes = the experts the routing
actually hits (w13 + w2) over that time against the copy bandwidth; TFLOP/s = 2 * T * k * 3 * H * I
over the time, against cuBLAS on a dense GEMM pair of the same FLOPs ([T*k, H] x [H, 2I], [T*k, I] x
[I, H]). Routing: top-k of random logits (about uniform over experts).
Peer, same weights and routing: transformers' experts module (Qwen3MoeExperts, the layout ours loads)
with its experts_implementation "grouped_mm" (torch._grouped_mm) and "eager", timed eagerly (CUDA
events around many calls), beside ours timed the same way.

  pageflash bench kernels --moe [--moe-int8 | --moe-quant int8|fp8|fp8-w8a8] [--moe-tokens 1 8 64 ...]
  python -m pageflash.bench.moe [--configs] [--align] [--quant none int8 fp8 fp8-w8a8] [--tokens ...]
                                [--shapes ...] [--json FILE]
      (--quant: experts as INT8 or e4m3 codes with a scale per row; fp8 weight-only (codes widened),
       fp8-w8a8 with the activations' rows quantized too; one table row per (layer, quant, T))
      (--configs: sweep CANDIDATES per token count; --align: the routing + grouping variants alone)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Optional

import torch

from pageflash.bench.roofline import measure_copy_bandwidth
from pageflash.kernels import fused_moe as fm
from pageflash.layers.moe import experts_ref, route

SHAPES = {  # name: (H, I, E, k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen1.5-moe-a2.7b": (2048, 1408, 60, 4),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
DEFAULT_TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
CANDIDATES = [  # (the gated first GEMM takes half of BLOCK_N)
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, GROUP_M=1, num_warps=2, num_stages=4),
    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, num_warps=2, num_stages=5),
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    # 1-byte operands (e4m3 W8A8): K tiles of 128-256 bytes
    dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=512, GROUP_M=1, num_warps=4, num_stages=3),
    dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=256, GROUP_M=8, num_warps=4, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=256, GROUP_M=8, num_warps=8, num_stages=3),
]


def graph_time_us(fn, iters: int = 30, reps: int = 5) -> float:
    """Median µs of one fn() replayed from a CUDA graph (iters calls per replay)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(times)


def eager_time_us(fn, iters: int = 20, reps: int = 5) -> float:
    """Median µs of one fn() called eagerly (host launches included), iters calls per measurement."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(times)


def hf_experts(h: int, inter: int, e: int, k: int, w13: torch.Tensor, w2: torch.Tensor, impl: str):
    """transformers' Qwen3MoeExperts over these weights with experts_implementation impl, or None."""
    try:
        from transformers import AutoConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

        cfg = AutoConfig.for_model("qwen3_moe", hidden_size=h, moe_intermediate_size=inter, num_experts=e,
                                   num_experts_per_tok=k)
        cfg._experts_implementation = impl
        m = Qwen3MoeExperts(cfg).to(device=w13.device, dtype=w13.dtype)
        m.gate_up_proj.data = w13
        m.down_proj.data = w2
        return m
    except Exception as ex:  # an older transformers without experts implementations
        print(f"transformers experts ({impl}) unavailable: {ex!r}"[:200])
        return None


def align_probe(tokens) -> None:
    """µs (CUDA graph) of routing + grouping: route_align fused (one launch), two launches (histogram /
    comparison counts), and route() + moe_align() in torch ops."""
    dev = torch.device("cuda")
    print("| E, k | T | fused | two (hist) | two (compare) | torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for e, k in ((128, 8), (60, 4), (8, 2)):
        for t in tokens:
            if not fm.route_align_fits(t, e, k):
                continue
            logits = torch.randn(t, e, device=dev)
            res = []
            for variant in ("fused", "hist", "compare"):
                fm.ALIGN_HIST = variant != "compare"
                res.append(graph_time_us(lambda: fm.route_align(logits, k, True, 16, fused=variant == "fused")))
            fm.ALIGN_HIST = True
            res.append(graph_time_us(lambda: fm.moe_align(route(logits, k, True)[1], e, 16)))
            print(f"| {e}, {k} | {t} | " + " | ".join(f"{r:.1f}" for r in res) + " |", flush=True)


QUANTS = ("int8", "fp8", "fp8-w8a8")


def bench_moe(copy_gbps: float, shapes=None, tokens=None, sweep: bool = False, log: Optional[list] = None,
              quant: Optional[str] = None) -> list[dict]:
    """One row per (layer shape, T): the best of the configs tried (the default one unless sweep).
    quant: "int8", "fp8" (e4m3 experts, weight-only) or "fp8-w8a8" (W8A8); None: bf16 experts."""
    if quant not in (None,) + QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    dev = torch.device("cuda")
    rows = []
    log = [] if log is None else log
    g = torch.Generator(device=dev).manual_seed(0)
    for name in shapes or list(SHAPES):
        h, inter, e, k = SHAPES[name]
        w13 = (torch.randn(e, 2 * inter, h, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(e, h, inter, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        expert_bytes = (w13[0].numel() + w2[0].numel()) * 2
        sc, kw = {}, {}
        if quant is not None:
            from pageflash.layers.linear import quantize_weight

            q13, s13 = quantize_weight(w13.reshape(-1, h), quant.split("-")[0])
            q2, s2 = quantize_weight(w2.reshape(-1, inter), quant.split("-")[0])
            w13, w2 = q13.view(e, 2 * inter, h), q2.view(e, h, inter)
            sc = dict(w13_scale=s13.view(e, 2 * inter), w2_scale=s2.view(e, h))
            expert_bytes = w13[0].numel() + w2[0].numel() + 4 * (2 * inter + h)
            if quant.startswith("fp8"):
                kw = dict(w8a8=quant == "fp8-w8a8")
        for t in tokens or DEFAULT_TOKENS:
            x = torch.randn(t, h, device=dev, generator=g).to(torch.bfloat16)
            logits = torch.randn(t, e, device=dev, generator=g)
            wts, ids = route(logits, k, True)
            ref = experts_ref(x.float(), w13.float(), w2.float(), wts, ids,
                              *(v.float() for v in sc.values()))
            hit = int(torch.unique(ids).numel())
            nbytes = hit * expert_bytes + x.nbytes * 2
            flops = 2.0 * t * k * 3 * h * inter
            # dense cuBLAS of the same FLOPs
            xa = torch.randn(t * k, h, device=dev, dtype=torch.bfloat16)
            wa = torch.randn(2 * inter, h, device=dev, dtype=torch.bfloat16)
            xb = torch.randn(t * k, inter, device=dev, dtype=torch.bfloat16)
            wb = torch.randn(h, inter, device=dev, dtype=torch.bfloat16)
            dense_us = graph_time_us(lambda: (xa @ wa.t(), xb @ wb.t()))
            rows_per_expert = t * k / min(e, t * k)
            bms = (16,) if rows_per_expert <= 8 else ((16, 32, 64) if rows_per_expert <= 48 else (64, 128))
            cands = [c for c in CANDIDATES if c["BLOCK_M"] in bms] if sweep else [None]
            best = None
            for cfg in cands:
                try:
                    out = fm.routed_moe(x, logits, w13, w2, k, True, config=cfg, **sc, **kw)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    us = graph_time_us(lambda: fm.routed_moe(x, logits, w13, w2, k, True, config=cfg, **sc, **kw))
                except Exception as ex:  # e.g. out of shared memory
                    log.append(dict(shape=name, T=t, config=cfg, error=repr(ex)[:200]))
                    continue
                r = dict(shape=name, T=t, quant=quant, config=cfg or fm._config(t * k, e, quant == "fp8-w8a8"),
                         us=us, rel_err=err,
                         experts_hit=hit, gbps=nbytes / us / 1e3, pct_copy=100 * nbytes / us / 1e3 / copy_gbps,
                         tflops=flops / us / 1e6, dense_us=dense_us)
                log.append(r)
                if best is None or us < best["us"]:
                    best = r
            if best is not None:
                print(f"{name} T={t}: best {best['config']} {best['us']:.1f} µs", flush=True)
                bc = best["config"]
                best["ours_eager_us"] = eager_time_us(
                    lambda: fm.routed_moe(x, logits, w13, w2, k, True, config=bc, **sc, **kw))
                best["ours_prerouted_us"] = graph_time_us(
                    lambda: fm.fused_moe(x, w13, w2, wts, ids, config=bc, **sc, **kw))
                for impl in (() if quant else ("grouped_mm", "eager")):
                    if impl == "eager" and t > 256:
                        continue
                    m = hf_experts(h, inter, e, k, w13, w2, impl)
                    if m is None:
                        continue
                    wb = wts.to(torch.bfloat16)
                    with torch.no_grad():
                        y = m(x, ids, wb)
                        best[f"hf_{impl}_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                        best[f"hf_{impl}_us"] = eager_time_us(lambda: m(x, ids, wb))
                rows.append(best)
            torch.cuda.empty_cache()
    return rows


def format_moe(rows: list[dict], copy_gbps: float) -> str:
    out = [f"MoE block (router GEMM excluded), copy bandwidth {copy_gbps:.0f} GB/s",
           "| layer | T | config (BM,BN,BK,w,s) | µs (graph) | rel err | experts hit | GB/s | % copy | TFLOP/s "
           "| dense cuBLAS µs | ours eager µs | fused_moe (torch grouping) µs | HF grouped_mm µs | HF eager µs |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        c = r["config"]
        cs = f"{c['BLOCK_M']},{c['BLOCK_N']},{c['BLOCK_K']},{c['num_warps']},{c['num_stages']}"
        out.append(f"| {r['shape']}{' ' + r['quant'] if r['quant'] else ''} | {r['T']} | {cs} | {r['us']:.1f} | "
                   f"{r['rel_err']:.1e} | {r['experts_hit']} | {r['gbps']:.0f} | {r['pct_copy']:.0f}% | "
                   f"{r['tflops']:.0f} | {r['dense_us']:.1f} | {r['ours_eager_us']:.1f} | "
                   f"{r['ours_prerouted_us']:.1f} | {r.get('hf_grouped_mm_us', float('nan')):.1f} | "
                   f"{r.get('hf_eager_us', float('nan')):.1f} |")
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pageflash.bench.moe")
    ap.add_argument("--configs", action="store_true", help="sweep CANDIDATES (else the default config only)")
    ap.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--align", action="store_true", help="time the routing + grouping variants only")
    ap.add_argument("--int8", action="store_true", help="INT8 experts (codes + a scale per row)")
    ap.add_argument("--quant", nargs="+", default=None, choices=("none",) + QUANTS,
                    help="expert weights, one pass each: none (bf16), int8, fp8 (weight-only), fp8-w8a8")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("the MoE kernel benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.align:
        align_probe(a.tokens)
        return 0
    copy = measure_copy_bandwidth(torch.device("cuda"))
    log: list = []
    rows = []
    for q in a.quant or ["int8" if a.int8 else "none"]:
        rows += bench_moe(copy, a.shapes, a.tokens, sweep=a.configs, log=log, quant=None if q == "none" else q)
    print(format_moe(rows, copy))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(copy_gbps=copy, best=rows, all=log), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
