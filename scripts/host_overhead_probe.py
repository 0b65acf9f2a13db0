"""Host time per call of the attention launch wrappers (CUDA): tiny shapes, so that the GPU keeps up
and the wall time per call is the host's, with pageflash's fast launch path (kernels/launch.py) on and
off in alternating rounds. Usage: python scripts/host_overhead_probe.py

Rows: flash_decode (1 / 8 / 66 splits: two launches with splits), its split kernel launched bare with
the same arguments (and through the CompiledKernel that launch returned), a bare launch of an empty
kernel with 1 and with 45 arguments (plain and wrapped by fast_launch), torch SDPA, torch.empty.
"""
import time

import torch
import triton
import triton.language as tl

import pageflash.kernels.flash_decoding as fd
from pageflash.kernels.launch import fast_launch, set_fast_launch
from pageflash.bench.kernels import decode_case


@triton.jit
def _null1(X):
    pass


@triton.jit
def _null45(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
            a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, a36, a37, a38, a39,
            A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, E: tl.constexpr, F: tl.constexpr):
    pass


_null45_fast = fast_launch(_null45)


def per_call_us(fn, n=1000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


q, kc, vc, bt, sl = decode_case(1, 64)
x = torch.zeros(16, device="cuda")
ints = list(range(1, 29))
kk = kc[:4].flatten(0, 1).transpose(0, 1)[None].contiguous()
vv = vc[:4].flatten(0, 1).transpose(0, 1)[None].contiguous()
po = torch.empty((1, 32, 8, 128), device="cuda")
plse = torch.empty((1, 32, 8), device="cuda")
o = torch.empty_like(q)


def split_args(splits):
    return (q, kc, vc, o, po, plse, bt, sl, sl, q.stride(0), q.stride(1), o.stride(0), o.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), bt.stride(0),
            bt.shape[1], 0.1, splits, q, q, sl, q, q, sl) + (0,) * 6


def split_bare(splits):
    return fd._decode_split_kernel[(splits, 8, 1)](*split_args(splits), **split_kw(splits), num_warps=4,
                                                    num_stages=2)


def split_kw(splits):
    return dict(GROUP=4, BLOCK_H=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, PAGE_SIZE=16, SPLIT=splits > 1,
                FUSED=False, BT_AHEAD=1, STRIDED=True, BLOCK_S=1, PREC="tf32", ROPE=False)


def split_direct(splits):
    """The same launch through the CompiledKernel the JIT path returned (no binder, no cache key):
    what a cached launcher could save."""
    ck = split_bare(splits)
    args = split_args(splits)
    kw = split_kw(splits)
    names = fd._decode_split_kernel.arg_names
    full = list(args) + [kw[n] for n in names[len(args):]]
    runner = ck[(splits, 8, 1)]
    return lambda: runner(*full)


def lazy(factory, *a):
    """Build the timed function on first use (a factory that fails is reported as that row's failure)."""
    box = []

    def fn():
        if not box:
            box.append(factory(*a))
        return box[0]()
    return fn


rows = {
    "decode_config": lambda: fd.decode_config(128, q.dtype, q.device),
    "split kernel launch, bare, 1 split": lambda: split_bare(1),
    "split kernel launch, bare, 8 splits": lambda: split_bare(8),
    "split kernel, CompiledKernel runner, 8 splits": lazy(split_direct, 8),
    "current stream handle": lambda: torch.cuda.current_stream().cuda_stream,
    "flash_decode 66 splits": lambda: fd.flash_decode(q, kc, vc, bt, sl, 0.1, num_splits=66),
    "combine_partials, 8 splits": lambda: fd.combine_partials(o, po, plse, lens=(sl, 64), strided=True),
    "flash_decode 1 split": lambda: fd.flash_decode(q, kc, vc, bt, sl, 0.1, num_splits=1),
    "flash_decode 8 splits": lambda: fd.flash_decode(q, kc, vc, bt, sl, 0.1, num_splits=8),
    "empty kernel, 1 arg": lambda: _null1[(1,)](x),
    "empty kernel, 40 args + 5 constexpr": lambda: _null45[(1,)](x, x, x, x, x, x, x, x, x, x, x, x, *ints,
                                                               A=1, B=2, C=3, E=4, F=5),
    "empty kernel, 40 args + 5 constexpr, fast_launch": lambda: _null45_fast[(1,)](
        x, x, x, x, x, x, x, x, x, x, x, x, *ints, A=1, B=2, C=3, E=4, F=5),
    "torch.empty x3": lambda: (torch.empty(4, device="cuda"), torch.empty(4, device="cuda"),
                               torch.empty(4, device="cuda")),
    "torch SDPA (GQA)": lambda: torch.nn.functional.scaled_dot_product_attention(
        q.view(1, 32, 1, 128), kk, vv, enable_gqa=True),
}
print(f"host us per call (triton {triton.__version__}, torch {torch.__version__}); best of 4 rounds each, "
      "pageflash's fast launch path on and off alternating")
print(f"  {'':<48}{'fast':>8}{'triton':>8}")
for name, fn in rows.items():
    best = {True: float("inf"), False: float("inf")}
    try:
        for _ in range(4):
            for flag in (True, False):
                set_fast_launch(flag)
                best[flag] = min(best[flag], per_call_us(fn))
        print(f"  {name:<48}{best[True]:8.1f}{best[False]:8.1f}", flush=True)
    except Exception as e:  # e.g. the CompiledKernel API of another Triton version
        print(f"  {name:<48}  failed: {type(e).__name__}: {str(e)[:100]}", flush=True)
set_fast_launch(True)
