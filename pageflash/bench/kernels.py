"""Attention kernel benchmarks: ``pageflash bench kernels [--prefill] [--decode] [--backward] [--json F]``.

- prefill (W-attn-prefill): causal bf16 (B, H, N, D) in {(4,32,4096,128), (16,16,2048,64),
  (1,32,16384,128)}; our FlashAttention-2 kernel (and the paged prefill kernel over a block-size-16
  cache holding the same K/V) vs torch SDPA's FLASH_ATTENTION, CUDNN_ATTENTION and EFFICIENT_ATTENTION
  backends, TFLOP/s with FLOPs = 4*B*H*N*N*D/2.
- decode (W-attn-decode): one query per sequence, 32 query heads over 8 KV heads, D 128, bf16, block
  size 16 (pages shuffled), (B, L) in {(1,32768), (8,8192), (64,2048), (1,131072), (256,1024)}; K+V
  bytes / time vs a measured device-to-device copy bandwidth and vs SDPA on contiguous KV. Timed as
  CUDA-graph replays (both sides), which also checks that the decode path is graph-safe. Also timed
  over the same cache with each sequence's pages in order (what a fresh pool hands a long prompt), and
  over SDPA's own contiguous buffers seen as a paged cache (``contiguous_as_cache``: the same bytes in
  the same places as SDPA reads them, so kernel against kernel). And over a quantized cache
  (kv_cache_dtype int8 / fp8: the same keys as 1-byte codes plus a float32 scale per token and KV
  head), GB/s of the bytes it reads.
- backward: the prefill shapes, TFLOP/s with FLOPs = 2.5 x forward, vs SDPA's backward.

Timing: ``triton.testing.do_bench`` (median); random inputs. ``--sweep`` also times a few tile
configs per kernel (used to set the static config tables). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Callable, Optional

import torch

PREFILL_SHAPES = [(4, 32, 4096, 128), (16, 16, 2048, 64), (1, 32, 16384, 128)]
DECODE_SHAPES = [(1, 32768), (8, 8192), (64, 2048), (1, 131072), (256, 1024)]
DECODE_HEADS = (32, 8, 128)  # Hq, Hkv, D
PAGE = 16
SDPA_BACKENDS = ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"]


def _bench(fn: Callable[[], object], graph: bool = False) -> float:
    """Median milliseconds of fn (graph: CUDA-graph replays)."""
    import triton.testing

    if graph:
        # do_bench_cudagraph runs fn on a side stream, which does not wait for the inputs' producers on
        # the current one: a block table still being filled read as garbage block ids (run 50: an
        # illegal address in a probe that did not synchronize first)
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _try(fn: Callable[[], float]) -> Optional[float]:
    try:
        return fn()
    except Exception as e:  # a backend missing on this build/GPU: reported as n/a
        print(f"    (n/a: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})", file=sys.stderr)
        return None


def _sdpa(backend: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, backend))


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    src = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------


def _paged_from_contiguous(k: torch.Tensor, v: torch.Tensor, page: int = PAGE):
    """(B, H, N, D) K/V -> shuffled paged caches + metadata for the paged prefill kernel."""
    b, h, n, d = k.shape
    nb = (n + page - 1) // page
    perm = torch.randperm(b * nb, device=k.device).to(torch.int32)
    bt = perm.view(b, nb)
    kc = torch.empty(b * nb, page, h, d, device=k.device, dtype=k.dtype)
    vc = torch.empty_like(kc)
    kt = k.transpose(1, 2).reshape(b, nb, page, h, d)  # assumes n % page == 0
    kc[bt.long()] = kt
    vc[bt.long()] = v.transpose(1, 2).reshape(b, nb, page, h, d)
    return kc, vc, bt


def bench_prefill(sweep: bool) -> list[dict]:
    import torch.nn.functional as F

    from pageflash.kernels.flash_attention import flash_attn_varlen_fwd, fwd_config
    from pageflash.kernels.paged_attention import paged_attention

    rows = []
    for b, h, n, d in PREFILL_SHAPES:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * n * n * d / 2
        tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
        row = {"shape": [b, h, n, d]}
        # ours, SDPA layout (B, H, N, D): the varlen entry with batched strides
        from pageflash.kernels.flash_attention import _fwd

        def ours(cfg=None):
            return _fwd(q, k, v, None, n, True, d**-0.5, False, cfg)

        row["ours"] = tf(_bench(ours))
        if sweep:
            base = fwd_config(d, q.dtype, q.device)
            res = {}
            for bm, bn, w, s in [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2),
                                 (128, 32, 4, 4), (64, 64, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3)]:
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                r = _try(lambda: tf(_bench(lambda: ours(cfg))))
                res[f"{bm}x{bn} w{w} s{s}"] = r
            row["sweep"] = res
            row["config"] = base
        # the paged prefill kernel over the same K/V (prefill of B sequences of N tokens)
        kc, vc, bt = _paged_from_contiguous(k, v)
        qf = q.transpose(1, 2).reshape(b * n, h, d)
        qsl = torch.arange(0, (b + 1) * n, n, device="cuda", dtype=torch.int32)
        sl = torch.full((b,), n, device="cuda", dtype=torch.int32)
        from pageflash.kernels.paged_attention import build_tiles, prefill_config

        pcfg = prefill_config(d, 1, n, q.dtype, q.device)
        tiles = build_tiles([n] * b, [n] * b, pcfg["BLOCK_M"], q.device)
        torch.cuda.synchronize()
        row["ours_paged"] = tf(_bench(lambda: paged_attention(qf, kc, vc, qsl, sl, bt, d**-0.5, [n] * b, [n] * b,
                                                              tiles=tiles)))
        if sweep:
            res = {}
            for bm, bn, w, s in [(128, 64, 8, 3), (128, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 2),
                                 (64, 64, 4, 3), (128, 64, 8, 4), (128, 64, 8, 2), (64, 32, 4, 4)]:
                cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
                tl_ = build_tiles([n] * b, [n] * b, bm, q.device)
                res[f"{bm}x{bn} w{w} s{s}"] = _try(lambda: tf(_bench(lambda: paged_attention(
                    qf, kc, vc, qsl, sl, bt, d**-0.5, [n] * b, [n] * b, tiles=tl_, config=cfg))))
            row["sweep_paged"] = res
        # ours varlen entry (tokens-major [B*N, H, D])
        kf, vf = k.transpose(1, 2).reshape(b * n, h, d), v.transpose(1, 2).reshape(b * n, h, d)
        row["ours_varlen"] = tf(_bench(lambda: flash_attn_varlen_fwd(qf, kf, vf, qsl, n, causal=True)))
        del kc, vc, kf, vf, qf
        for be in SDPA_BACKENDS:

            def run(be=be):
                with _sdpa(be):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    torch.cuda.synchronize()
                    return tf(_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)))

            row[be] = _try(run)
        rows.append(row)
        print(f"prefill {row['shape']}: " + ", ".join(
            f"{key} {val:.0f}" for key, val in row.items() if isinstance(val, float)), flush=True)
        if sweep:
            for key in ("sweep", "sweep_paged"):
                print(f"   {key}: " + ", ".join(f"{kk}: {vv:.0f}" if vv else f"{kk}: n/a"
                                             for kk, vv in row[key].items()), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------


def decode_case(b: int, L: int, seed: int = 0, heads: tuple[int, int, int] = DECODE_HEADS,
                length: Optional[int] = None):
    """W-attn-decode inputs: (q, k_cache, v_cache, block_tables, seq_lens) for b sequences of L keys
    (block tables L keys wide; ``length``: sequences of that many keys instead, a table planned for
    more), bf16, ``heads`` (Hq, Hkv, D), page PAGE, the pages shuffled over a pool of
    b * ceil(L / PAGE) + 1 blocks."""
    hq, hkv, d = heads
    torch.manual_seed(seed)
    nb = (L + PAGE - 1) // PAGE
    kc = torch.randn(b * nb + 1, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    bt = torch.randperm(b * nb + 1, device="cuda")[: b * nb].to(torch.int32).view(b, nb)
    sl = torch.full((b,), L if length is None else length, device="cuda", dtype=torch.int32)
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16)
    return q, kc, vc, bt, sl


def contiguous_kv(kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor, length: Optional[int] = None):
    """The paged caches' keys and values of each sequence gathered into SDPA's contiguous
    [B, Hkv, L, D] buffers (the table's whole width, or the first ``length`` keys)."""
    def gather(c):
        return c[bt.long()].flatten(1, 2)[:, :length].transpose(1, 2).contiguous()
    return gather(kc), gather(vc)


def pages_in_order(bt: torch.Tensor) -> torch.Tensor:
    """A block table of bt's shape whose sequences hold the pool's blocks in ascending order (sequence 0
    blocks 0..W-1, then the next): the layout a fresh pool hands long prompts."""
    return torch.arange(bt.numel(), device=bt.device, dtype=torch.int32).view_as(bt)


def contiguous_as_cache(kk: torch.Tensor, vv: torch.Tensor, page: int = PAGE):
    """Contiguous [B, Hkv, L, D] K/V (what SDPA reads; L a multiple of page) seen as a paged cache
    without copying: blocks of `page` rows (block stride page * D, slot stride D, head stride L * D),
    each sequence's blocks listed in order. Returns (k_cache, v_cache, block_tables): the paged kernel
    then reads the very bytes SDPA reads, where they lie."""
    b, hkv, L, d = kk.shape
    if L % page or not (kk.is_contiguous() and vv.is_contiguous()) or kk.shape != vv.shape:
        raise ValueError(f"contiguous_as_cache: needs contiguous [B, Hkv, L, D] K/V with L a multiple of {page}, "
                         f"got {tuple(kk.shape)} and {tuple(vv.shape)}")
    per_seq = hkv * L // page  # block ids per sequence's stretch of the buffer
    nb = (b - 1) * per_seq + L // page  # the last sequence's last block ends at the buffer's end
    shape, stride = (nb, page, hkv, d), (page * d, d, L * d, 1)
    bt = (torch.arange(b, device=kk.device, dtype=torch.int32)[:, None] * per_seq
          + torch.arange(L // page, device=kk.device, dtype=torch.int32)[None, :])
    return kk.as_strided(shape, stride), vv.as_strided(shape, stride), bt


def engine_block_tables(b: int, L: int, pool: int, churn: bool, seed: int = 0, device: str = "cuda",
                        locality_tokens: int = 64) -> torch.Tensor:
    """Block tables [b, ceil(L / PAGE)] as the engine's KVCacheManager hands them out in a pool of
    `pool` blocks: b prompts of L - G tokens (G = min(L / 4, 512)) get their blocks at once, as a
    prefill does, then grow one token per step together for G tokens, so that the blocks decode adds
    interleave between the sequences. churn: first 3 x b requests of random prompt (100-1024) and
    output (1-512) lengths pass through the pool, b at a time with continuous batching, so that its
    free queue is in freeing order (a pool that has served for a while). locality_tokens: the
    KVCacheManager's (0: the plain LRU queue)."""
    import random

    from pageflash.engine.kv_cache import KVCacheManager

    rnd = random.Random(seed)
    kv = KVCacheManager(pool, PAGE, enable_prefix_caching=True, locality_tokens=locality_tokens)
    if churn:
        running: dict[str, list[int]] = {}  # seq id -> [tokens so far, length at which it finishes]
        todo, n = 3 * b, 0
        while todo or running:
            while todo and len(running) < b:
                p, o = rnd.randint(100, 1024), rnd.randint(1, 512)
                if not kv.allocate(f"c{n}", 0, p):
                    break
                running[f"c{n}"] = [p, p + o]
                n, todo = n + 1, todo - 1
            for sid in list(running):
                cur, end = running[sid]
                if cur >= end or not kv.allocate(sid, cur, 1):
                    kv.free(sid)
                    del running[sid]
                else:
                    running[sid][0] = cur + 1
    g = min(L // 4, 512)
    steps = [(0, L - g)] + [(L - g + t, 1) for t in range(g)]  # the prefill, then one token per step
    for start, n in steps:
        for i in range(b):
            if not kv.allocate(f"s{i}", start, n):
                raise ValueError(f"engine_block_tables: a pool of {pool} blocks is too small for {b} x {L} tokens")
    return torch.tensor([kv.block_ids(f"s{i}") for i in range(b)], dtype=torch.int32, device=device)


DECODE_CHECK_CASES = [(3, 1000, 1), (2, 777, 4), (1, 4097, 7), (4, 17, 3), (5, 64 * 9 + 1, 2)]


def decode_config_mismatches(configs: list[dict], cases=DECODE_CHECK_CASES, tol: float = 2e-2) -> list[tuple]:
    """flash_decode with each config (a decode_config override) against flash_decode_ref over
    (batch, length, splits) cases, random lengths up to the case's: the (config, case, max error) pairs
    off by tol or more. The decode probes run it before timing their configs."""
    from pageflash.kernels.flash_decoding import flash_decode, flash_decode_ref

    d = DECODE_HEADS[2]
    bad = []
    for cfg in configs:
        for b, L, sp in cases:
            q, kc, vc, bt, sl = decode_case(b, L, seed=L)
            sl = torch.randint(1, L + 1, (b,), device="cuda", dtype=torch.int32)
            ref = flash_decode_ref(q, kc, vc, bt, sl, d ** -0.5).float()
            out = flash_decode(q, kc, vc, bt, sl, d ** -0.5, num_splits=sp, config=cfg).float()
            err = (out - ref).abs().max().item()
            if not err < tol:
                bad.append((cfg, (b, L, sp), err))
    return bad


def bench_decode(sweep: bool, bw: float) -> list[dict]:
    import torch.nn.functional as F

    from pageflash.kernels.flash_decoding import choose_num_splits, flash_decode
    from pageflash.layers.attention import quantize_kv_ref

    hq, hkv, d = DECODE_HEADS
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for b, L in DECODE_SHAPES:
        q, kc, vc, bt, sl = decode_case(b, L)
        nb = bt.shape[1]
        nbytes = 2 * b * L * hkv * d * 2
        gbs = lambda ms: nbytes / (ms * 1e-3) / 1e9  # noqa: E731
        splits = choose_num_splits(b, hkv, nb * PAGE, sms)
        row = {"shape": [b, L], "splits": splits}
        torch.cuda.synchronize()  # do_bench_cudagraph runs on a side stream: the inputs must be ready
        counters = torch.zeros(b * hkv, device="cuda", dtype=torch.int32)
        torch.cuda.synchronize()
        ms = _bench(lambda: flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits), graph=True)
        row["ours_us"] = ms * 1e3
        row["ours_GBs"] = gbs(ms)
        row["ours_pct_copy"] = 100 * gbs(ms) / bw
        # the same kernel with each sequence's pages in order (physical blocks ascending)
        bt_seq = pages_in_order(bt)
        torch.cuda.synchronize()
        row["ours_inorder_us"] = 1e3 * _bench(
            lambda: flash_decode(q, kc, vc, bt_seq, sl, d**-0.5, num_splits=splits), graph=True)
        # the block tables the engine's allocator hands out (a pool twice the batch's size, fresh and
        # after churn): what a serving engine's decode reads, between the two layouts above
        pool = 2 * b * nb
        kc2 = torch.randn(pool, PAGE, hkv, d, device="cuda", dtype=kc.dtype)
        vc2 = torch.randn_like(kc2)
        for name, churn in (("fresh", False), ("churned", True)):
            bt_e = engine_block_tables(b, L, pool, churn)
            torch.cuda.synchronize()
            row[f"ours_engine_{name}_us"] = 1e3 * _bench(
                lambda bt_e=bt_e: flash_decode(q, kc2, vc2, bt_e, sl, d**-0.5, num_splits=splits), graph=True)
        del kc2, vc2
        # eager launches as well (do_bench: events around each call, L2 flushed between calls), as a
        # caller outside a CUDA graph sees them; SDPA likewise below
        row["ours_eager_us"] = 1e3 * _bench(lambda: flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits))
        if splits > 1:  # combine fused into the split kernel (TritonBackend(fused_combine=True))
            row["ours_fused_us"] = 1e3 * _bench(
                lambda: flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits, counters=counters), graph=True)
        # a quantized cache (kv_cache_dtype int8 / fp8): the same keys as codes + a float32 scale per
        # (token, KV head); bytes read = codes + scales
        for name, code in (("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
            kq, ks = quantize_kv_ref(kc, code)
            vq, vs = quantize_kv_ref(vc, code)
            sc = (ks.transpose(1, 2).contiguous(), vs.transpose(1, 2).contiguous())
            del ks, vs
            qbytes = 2 * b * L * hkv * (d * code.itemsize + 4)
            torch.cuda.synchronize()
            ms = _bench(lambda: flash_decode(q, kq, vq, bt, sl, d**-0.5, num_splits=splits, kv_scales=sc), graph=True)
            row[f"ours_{name}_us"] = ms * 1e3
            row[f"ours_{name}_GBs"] = qbytes / (ms * 1e-3) / 1e9
            row[f"ours_{name}_pct_copy"] = 100 * row[f"ours_{name}_GBs"] / bw
            del kq, vq, sc
        if sweep:
            res = {}
            for a, st, bn, w, s in [(1, 1, 64, 4, 2), (1, 1, 64, 4, 3), (1, 0, 64, 4, 2), (0, 0, 64, 4, 3),
                                    (1, 1, 32, 4, 3), (1, 1, 32, 4, 4), (1, 1, 128, 4, 2), (1, 1, 64, 8, 2)]:
                cfg = dict(BLOCK_N=bn, num_warps=w, num_stages=s, BT_AHEAD=a, STRIDED=bool(st))
                for sp in sorted({max(1, splits // 2), splits, splits * 2}):
                    for fused in (False,):
                        r = _try(lambda: gbs(_bench(lambda: flash_decode(
                            q, kc, vc, bt, sl, d**-0.5, num_splits=sp, config=cfg,
                            counters=counters if fused else None), graph=True)))
                        res[f"a{a}{'S' if st else 'C'} n{bn} w{w} s{s} sp{sp}{' fused' if fused and sp > 1 else ''}"] = r
            row["sweep"] = res
        # SDPA on contiguous KV, GQA handled by SDPA
        kk, vv = contiguous_kv(kc, vc, bt)  # [B, Hkv, L, D]
        del kc, vc
        q4 = q.view(b, hq, 1, d)
        # our kernel over SDPA's own buffers (kernel against kernel on the same bytes in the same places)
        kc_c, vc_c, bt_c = contiguous_as_cache(kk, vv)
        torch.cuda.synchronize()
        row["ours_sdpa_layout_us"] = 1e3 * _bench(
            lambda: flash_decode(q, kc_c, vc_c, bt_c, sl, d**-0.5, num_splits=splits), graph=True)

        def sdpa():
            return F.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)

        sdpa()
        torch.cuda.synchronize()
        ms = _try(lambda: _bench(sdpa, graph=True))
        row["sdpa_us"] = ms * 1e3 if ms else None
        row["sdpa_eager_us"] = _try(lambda: _bench(sdpa) * 1e3)
        row["sdpa_GBs"] = gbs(ms) if ms else None
        for be in ["FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"]:

            def run(be=be):
                with _sdpa(be):
                    sdpa()
                    return _bench(sdpa, graph=True) * 1e3

            row[f"sdpa_{be}_us"] = _try(run)
        rows.append(row)
        print(f"decode B{b} L{L}: splits {splits}, ours {row['ours_us']:.1f} us {row['ours_GBs']:.0f} GB/s "
              f"({row['ours_pct_copy']:.0f}% of copy), pages in order {row['ours_inorder_us']:.1f} us, over sdpa's "
              f"buffers {row['ours_sdpa_layout_us']:.1f} us, eager "
              f"{row['ours_eager_us']:.1f} us (sdpa {row['sdpa_eager_us'] or float('nan'):.1f}), fused combine {row.get('ours_fused_us', float('nan')):.1f} us, sdpa {row['sdpa_us'] or float('nan'):.1f} us; "
              + ", ".join(f"{k_} {v_:.1f}" for k_, v_ in row.items() if k_.startswith("sdpa_") and k_.endswith("_us")
                          and k_ != "sdpa_us" and v_),
              flush=True)
        if sweep:
            best = sorted(((v_, k_) for k_, v_ in row["sweep"].items() if v_), reverse=True)[:6]
            print("   sweep best: " + ", ".join(f"{k_}: {v_:.0f} GB/s" for v_, k_ in best), flush=True)
        del kk, vv, kc_c, vc_c, q
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------------


def bench_backward(sweep: bool) -> list[dict]:
    import torch.nn.functional as F

    from pageflash.kernels.flash_attention import _bwd, _fwd

    rows = []
    for b, h, n, d in PREFILL_SHAPES:
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        flops = 2.5 * 4 * b * h * n * n * d / 2
        tf = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
        row = {"shape": [b, h, n, d]}
        o, lse = _fwd(q, k, v, None, n, True, d**-0.5, False)
        row["ours"] = tf(_bench(lambda: _bwd(do, q, k, v, o, lse, None, n, True, d**-0.5, False)))
        if sweep:
            res = {}
            for m1, n1, m2, n2, w, s in [(32, 128, 128, 32, 4, 3), (32, 128, 128, 32, 4, 4), (64, 128, 128, 64, 8, 3),
                                         (32, 64, 64, 32, 4, 3), (64, 64, 64, 64, 4, 3), (32, 128, 128, 32, 8, 3)]:
                cfg = dict(BLOCK_M1=m1, BLOCK_N1=n1, BLOCK_M2=m2, BLOCK_N2=n2, num_warps=w, num_stages=s)
                res[f"{m1}x{n1}/{m2}x{n2} w{w} s{s}"] = _try(
                    lambda: tf(_bench(lambda: _bwd(do, q, k, v, o, lse, None, n, True, d**-0.5, False, cfg))))
            row["sweep"] = res
        del o, lse
        qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
        for be in SDPA_BACKENDS:

            def run(be=be):
                with _sdpa(be):
                    out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
                    return tf(_bench(lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)))

            row[be] = _try(run)
        rows.append(row)
        print(f"backward {row['shape']}: " + ", ".join(
            f"{key} {val:.0f}" for key, val in row.items() if isinstance(val, float)), flush=True)
        if sweep:
            print("   sweep: " + ", ".join(f"{kk}: {vv:.0f}" if vv else f"{kk}: n/a" for kk, vv in row["sweep"].items()),
                  flush=True)
        del q, k, v, do, qg, kg, vg
        torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def _fmt(x: Optional[float], nd: int = 0) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def print_tables(result: dict) -> None:
    if result.get("prefill"):
        print("\nW-attn-prefill (causal bf16, TFLOP/s)")
        print(f"{'B,H,N,D':<18}{'ours':>7}{'paged':>7}{'varlen':>7}{'FA2':>7}{'cuDNN':>7}{'effic':>7}{'ours/FA2':>10}")
        for r in result["prefill"]:
            fa = r.get("FLASH_ATTENTION")
            print(f"{','.join(map(str, r['shape'])):<18}{_fmt(r['ours']):>7}{_fmt(r['ours_paged']):>7}"
                  f"{_fmt(r['ours_varlen']):>7}{_fmt(fa):>7}{_fmt(r.get('CUDNN_ATTENTION')):>7}"
                  f"{_fmt(r.get('EFFICIENT_ATTENTION')):>7}{_fmt(r['ours'] / fa * 100 if fa else None):>9}%")
    if result.get("decode"):
        print(f"\nW-attn-decode (bf16, Hq 32 / Hkv 8, D 128, page 16; copy {result['copy_GBs']:.0f} GB/s)")
        print(f"{'B,L':<12}{'splits':>7}{'ours us':>9}{'GB/s':>7}{'%copy':>7}{'sdpa us':>9}{'sdpa/ours':>10}"
              f"{'in-order us':>12}{'sdpa/in-order':>14}{'on sdpa KV us':>14}{'sdpa/that':>10}")
        for r in result["decode"]:
            su, io, sl_ = r.get("sdpa_us"), r.get("ours_inorder_us"), r.get("ours_sdpa_layout_us")
            print(f"{','.join(map(str, r['shape'])):<12}{r['splits']:>7}{r['ours_us']:>9.1f}{r['ours_GBs']:>7.0f}"
                  f"{r['ours_pct_copy']:>6.0f}%{_fmt(su, 1):>9}{_fmt(su / r['ours_us'] if su else None, 2):>10}"
                  f"{_fmt(io, 1):>12}{_fmt(su / io if su and io else None, 2):>14}"
                  f"{_fmt(sl_, 1):>14}{_fmt(su / sl_ if su and sl_ else None, 2):>10}")
        print("(ours: pages shuffled over the pool; in-order: each sequence's pages ascending; on sdpa KV: our "
              "kernel over SDPA's own contiguous buffers seen as a paged cache)")
        print("the engine allocator's block tables (bench.kernels.engine_block_tables), us (sdpa/that):")
        for r in result["decode"]:
            su = r.get("sdpa_us")
            print(f"  B{r['shape'][0]} L{r['shape'][1]}: "
                  + ", ".join(f"{k} {_fmt(r.get(f'ours_engine_{k}_us'), 1)} "
                              f"({_fmt(su / r[f'ours_engine_{k}_us'] if su and r.get(f'ours_engine_{k}_us') else None, 3)})"
                              for k in ("fresh", "churned")))
        print("quantized KV cache (codes + a float32 scale per token and KV head; GB/s of those bytes), us "
              "(bf16 ours / that, sdpa bf16 / that):")
        for r in result["decode"]:
            su = r.get("sdpa_us")
            print(f"  B{r['shape'][0]} L{r['shape'][1]}: "
                  + ", ".join(f"{k} {_fmt(r.get(f'ours_{k}_us'), 1)} ({_fmt(r.get(f'ours_{k}_GBs'))} GB/s, "
                              f"{_fmt(r.get(f'ours_{k}_pct_copy'))}% copy; "
                              f"{_fmt(r['ours_us'] / r[f'ours_{k}_us'] if r.get(f'ours_{k}_us') else None, 2)}x, "
                              f"{_fmt(su / r[f'ours_{k}_us'] if su and r.get(f'ours_{k}_us') else None, 2)}x)"
                              for k in ("int8", "fp8")))
        print("eager launches (do_bench, L2 flushed between calls), us:")
        for r in result["decode"]:
            print(f"  B{r['shape'][0]} L{r['shape'][1]}: ours {_fmt(r.get('ours_eager_us'), 1)}, "
                  f"sdpa {_fmt(r.get('sdpa_eager_us'), 1)}")
    if result.get("backward"):
        print("\nBackward (causal bf16, TFLOP/s, FLOPs = 2.5 x forward)")
        print(f"{'B,H,N,D':<18}{'ours':>7}{'FA2':>7}{'cuDNN':>7}{'effic':>7}{'ours/FA2':>10}")
        for r in result["backward"]:
            fa = r.get("FLASH_ATTENTION")
            print(f"{','.join(map(str, r['shape'])):<18}{_fmt(r['ours']):>7}{_fmt(fa):>7}"
                  f"{_fmt(r.get('CUDNN_ATTENTION')):>7}{_fmt(r.get('EFFICIENT_ATTENTION')):>7}"
                  f"{_fmt(r['ours'] / fa * 100 if fa else None):>9}%")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="pageflash bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", action="store_true", help="W-attn-prefill: forward TFLOP/s vs SDPA")
    p.add_argument("--decode", action="store_true", help="W-attn-decode: paged decode GB/s vs copy and SDPA")
    p.add_argument("--backward", action="store_true", help="backward TFLOP/s vs SDPA")
    p.add_argument("--moe", action="store_true", help="mixture-of-experts blocks at real layer shapes (not in the default set)")
    p.add_argument("--moe-int8", action="store_true", help="with --moe: INT8 experts")
    p.add_argument("--moe-quant", choices=("int8", "fp8", "fp8-w8a8"), default=None,
                   help="with --moe: INT8 or e4m3 experts (fp8: weight-only, fp8-w8a8: activations quantized too)")
    p.add_argument("--moe-tokens", type=int, nargs="+", default=None, metavar="T",
                   help="with --moe: token counts (default 1 4 16 64 256 1024 4096)")
    p.add_argument("--sweep", action="store_true", help="also time a few tile configs per kernel")
    p.add_argument("--json", metavar="PATH", help="write all numbers to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("pageflash bench kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    if not (args.prefill or args.decode or args.backward or args.moe):
        args.prefill = args.decode = args.backward = True
    import triton

    props = torch.cuda.get_device_properties(0)
    result: dict = {
        "gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
        "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    result["copy_GBs"] = copy_bandwidth()
    print(f"device-to-device copy: {result['copy_GBs']:.0f} GB/s (read + write)", flush=True)
    if args.prefill:
        result["prefill"] = bench_prefill(args.sweep)
    if args.decode:
        result["decode"] = bench_decode(args.sweep, result["copy_GBs"])
    if args.backward:
        result["backward"] = bench_backward(args.sweep)
    if args.moe:
        from pageflash.bench.moe import bench_moe, format_moe

        result["moe"] = bench_moe(result["copy_GBs"], tokens=args.moe_tokens, sweep=args.sweep,
                                  quant=args.moe_quant or ("int8" if args.moe_int8 else None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x)
    print_tables(result)
    if args.moe:
        print(format_moe(result["moe"], result["copy_GBs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
