"""Sliding-window attention kernels on the GPU: time with a window against the same kernel without
one, over the same long contexts, and against the plain kernel over a context as long as the window.

    PYTHONPATH=. python scripts/window_probe.py [--window 4096] [--context 16384]

Decode (Flash-Decoding over the paged cache, 32 / 8 heads, D 128, bf16, pages shuffled; the K/V
store and the split combine included, timed inside a CUDA graph): batch 1 / 16 / 64, each sequence
`context` long; bytes = the K/V the query reads (its window); % of the copy bandwidth measured in the
same process. Prefill: the contiguous varlen kernel over one `context`
prompt (TFLOP/s counted over the keys each query sees), and the paged kernel on a 2048-token chunk
at the end of a `context` sequence. Prints one table.
"""

from __future__ import annotations

import argparse

import torch

from pageflash.bench.moe import eager_time_us, graph_time_us
from pageflash.bench.roofline import measure_copy_bandwidth
from pageflash.kernels.backend import TritonBackend
from pageflash.kernels.flash_attention import flash_attn_varlen_fwd
from pageflash.layers.attention import AttentionMetadata

DEV = torch.device("cuda")


def paged_case(b: int, ctx: int, qlen: int, page: int = 16, hq: int = 32, hkv: int = 8, d: int = 128):
    nb = -(-(ctx + qlen) // page)
    total = b * nb + 1
    kc = torch.randn(total, page, hkv, d, device=DEV, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(total, device=DEV)[: b * nb].to(torch.int32).view(b, nb)
    q = torch.randn(b * qlen, hq, d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(b * qlen, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = []
    for i in range(b):
        p = torch.arange(ctx, ctx + qlen, device=DEV)
        slots.append(bt[i, p // page].long() * page + p % page)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(0, b * qlen + 1, qlen, dtype=torch.int32, device=DEV),
        seq_lens=torch.full((b,), ctx + qlen, dtype=torch.int32, device=DEV), block_tables=bt,
        slot_mapping=torch.cat(slots), query_lens_cpu=[qlen] * b, seq_lens_cpu=[ctx + qlen] * b, block_size=page)
    return q, k, v, kc, vc, meta


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=int, default=4096)
    ap.add_argument("--context", type=int, default=16384)
    a = ap.parse_args()
    w, L = a.window, a.context
    copy = measure_copy_bandwidth(DEV)
    rows = []
    be = TritonBackend()
    kv_tok = 2 * 8 * 128 * 2  # K and V bytes per key, one layer
    for b in (1, 16, 64):
        times = {}
        for label, ctx, win in (("full", L, None), ("window", L, w), ("short", w, None)):
            q, k, v, kc, vc, meta = paged_case(b, ctx - 1, 1)
            plan = be.plan(meta)
            times[label] = graph_time_us(lambda: be.forward(q, k, v, kc, vc, plan, 0.088, window=win), iters=20)
            del q, k, v, kc, vc
        gbs = b * min(w, L) * kv_tok / times["window"] / 1e3
        rows.append((f"decode B{b} L{L}", times["full"], times["window"], times["short"],
                     f"{gbs:.0f} GB/s = {100 * gbs / copy:.0f}% of copy"))
    # prefill: one prompt of L tokens, contiguous varlen kernel
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(L, 32, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(L, 8, 128, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    cu = torch.tensor([0, L], dtype=torch.int32, device=DEV)
    t_full = eager_time_us(lambda: flash_attn_varlen_fwd(q, k, v, cu, L, True, 0.088), iters=1, reps=10)
    t_win = eager_time_us(lambda: flash_attn_varlen_fwd(q, k, v, cu, L, True, 0.088, window=w), iters=1, reps=10)
    cw = torch.tensor([0, w], dtype=torch.int32, device=DEV)
    t_short = eager_time_us(lambda: flash_attn_varlen_fwd(q[:w], k[:w], v[:w], cw, w, True, 0.088), iters=1, reps=10)
    keys = sum(min(p + 1, w) for p in range(L))
    tf = 4 * 32 * 128 * keys / t_win / 1e6
    rows.append((f"prefill varlen {L}", t_full, t_win, t_short, f"{tf:.0f} TFLOP/s over the window's keys"))
    # a 2048-token chunk at the end of an L-token sequence (chunked prefill), paged kernel
    q, k, v, kc, vc, meta = paged_case(1, L - 2048, 2048)
    plan = be.plan(meta)
    t_full = eager_time_us(lambda: be.forward(q, k, v, kc, vc, plan, 0.088), iters=1, reps=10)
    t_win = eager_time_us(lambda: be.forward(q, k, v, kc, vc, plan, 0.088, window=w), iters=1, reps=10)
    q2, k2, v2, kc2, vc2, meta2 = paged_case(1, w - 2048, 2048)
    plan2 = be.plan(meta2)
    t_short = eager_time_us(lambda: be.forward(q2, k2, v2, kc2, vc2, plan2, 0.088), iters=1, reps=10)
    keys = 2048 * w
    tf = 4 * 32 * 128 * keys / t_win / 1e6
    rows.append((f"chunk 2048 @ {L}", t_full, t_win, t_short, f"{tf:.0f} TFLOP/s over the window's keys"))
    print(f"copy bandwidth {copy:.0f} GB/s; window {w}; times in us (median): full context / window / "
          f"no window over a context of {w}")
    print(f"| shape | full | window | short ({w}) | window: |")
    print("| --- | --- | --- | --- | --- |")
    for name, f, wi, s, note in rows:
        print(f"| {name} | {f:.1f} | {wi:.1f} | {s:.1f} | {note} |")


if __name__ == "__main__":
    main()
