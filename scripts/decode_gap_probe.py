"""Where do the decode kernel's microseconds go, against cuDNN SDPA and a plain streaming read?

For each W-attn-decode shape, CUDA-graph replays (triton do_bench_cudagraph, median) of:
  ours       flash_decode as the backend calls it (split kernel + combine kernel)
  fused      the combine done by the last split program (counters)
  split      the split kernel alone (combine skipped: the output is wrong, timing only)
  cudnn      SDPA (its default pick, cuDNN on H100) on contiguous KV with enable_gqa
  stream     a plain Triton read of the same K+V bytes (contiguous, one wave of programs, sum out):
             what streaming those bytes costs with one launch
  null       an empty kernel (the graph's per-launch floor)
Usage: python scripts/decode_gap_probe.py [--shapes 1x32768 8x8192 ...] [--ncu NAME SHAPE]
--ncu NAME SHAPE: run NAME at SHAPE three times, profiling (cudaProfilerStart/Stop) the third call
only, for `ncu --profile-from-start off`.
"""

import argparse

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

import pageflash.kernels.flash_decoding as fd
from pageflash.bench.kernels import DECODE_HEADS, decode_case, pages_in_order

HQ, HKV, D = DECODE_HEADS


@triton.jit
def _stream_read(X, OUT, n_per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    base = X + pid * n_per_prog
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.range(0, n_per_prog, BLOCK, num_stages=4):
        acc += tl.load(base + i + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(OUT + pid, tl.sum(acc, 0))


@triton.jit
def _null(X):
    pass


def setup(b, L, seed=0):
    return decode_case(b, L, seed)


def fns(b, L):
    q, kc, vc, bt, sl = setup(b, L)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = fd.choose_num_splits(b, HKV, L, sms)
    counters = torch.zeros(b * HKV, device="cuda", dtype=torch.int32)
    sc = D ** -0.5
    out = {}
    out["ours"] = lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=splits)
    bt_seq = pages_in_order(bt)
    out["order"] = lambda: fd.flash_decode(q, kc, vc, bt_seq, sl, sc, num_splits=splits)  # pages in order
    if splits > 1:
        out["fused"] = lambda: fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=splits, counters=counters)
        real = fd.combine_partials

        def split_only():
            fd.combine_partials = lambda *a, **k: None
            try:
                return fd.flash_decode(q, kc, vc, bt, sl, sc, num_splits=splits)
            finally:
                fd.combine_partials = real
        out["split"] = split_only
    kk = kc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
    vv = vc[bt.long()].flatten(1, 2).transpose(1, 2).contiguous()
    q4 = q.view(b, HQ, 1, D)
    out["cudnn"] = lambda: torch.nn.functional.scaled_dot_product_attention(q4, kk, vv, enable_gqa=True)
    flat = torch.cat([kk.flatten(), vv.flatten()])
    nprog = 2 * sms
    per = triton.cdiv(flat.numel() // nprog, 8192) * 8192
    flat = torch.nn.functional.pad(flat, (0, per * nprog - flat.numel()))
    red = torch.empty(nprog, device="cuda", dtype=torch.float32)
    out["stream"] = lambda: _stream_read[(nprog,)](flat, red, per, BLOCK=8192, num_warps=8)
    out["null"] = lambda: _null[(1,)](red)
    ref = fd.flash_decode_ref(q, kc, vc, bt, sl, sc) if b * L <= 32768 else None
    return out, splits, 2 * b * L * HKV * D * 2, ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["1x32768", "8x8192", "64x2048", "1x131072", "256x1024"])
    ap.add_argument("--ncu", nargs=2, metavar=("NAME", "SHAPE"))
    a = ap.parse_args()
    if a.ncu:
        name, shape = a.ncu
        b, L = map(int, shape.split("x"))
        f = fns(b, L)[0][name]
        f(); f(); torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        f()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return
    rows = []
    for shape in a.shapes:
        b, L = map(int, shape.split("x"))
        f, splits, nbytes, ref = fns(b, L)
        if ref is not None:
            for name in ("ours", "fused"):
                if name in f:
                    err = (f[name]().float() - ref.float()).abs().max().item()
                    assert err < 2e-2, (name, err)
        torch.cuda.synchronize()
        t = {}
        for name, fn in f.items():
            fn()
            torch.cuda.synchronize()
            t[name] = do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
        rows.append((shape, splits, nbytes, t))
        print(shape, splits, {k: round(v, 2) for k, v in t.items()}, flush=True)
        del f
        torch.cuda.empty_cache()
    names = ["ours", "fused", "split", "cudnn", "stream", "null"]
    print(f"{'shape':<10}{'sp':>4}" + "".join(f"{n:>8}" for n in names) + f"{'GB/s ours':>10}{'stream':>8}")
    for shape, splits, nbytes, t in rows:
        print(f"{shape:<10}{splits:>4}" + "".join(f"{t.get(n, float('nan')):>8.1f}" for n in names)
              + f"{nbytes / t['ours'] / 1e3:>10.0f}{nbytes / t['stream'] / 1e3:>8.0f}")


if __name__ == "__main__":
    main()
