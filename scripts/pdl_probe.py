"""Does programmatic dependent launch (PDL) shorten chains of decode-sized GEMVs in a CUDA graph?

Chains of dependent skinny GEMMs (each one's output is the next one's input, M = 1, distinct weights
so that every weight comes from HBM), captured in a CUDA graph, per variant:
  cublas  torch.nn.functional.linear
  plain   the skinny kernel as pageflash has it
  pdl     the same launched with launch_pdl=True: gdc_wait / gdc_launch_dependents at the start
  *-late  the same with gdc_launch_dependents after the main loop (one successor in flight)
  pre     pdl + the program's first W tiles loaded before gdc_wait (they do not depend on the
          previous kernel), so the weight stream starts during the previous kernel's tail
Usage: python scripts/pdl_probe.py
"""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit(do_not_specialize=["M"])
def _gemv(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
          PDL: tl.constexpr, PRE: tl.constexpr, LATE: tl.constexpr):
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = 0
    if PRE:
        w0 = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                     mask=(offs_n[:, None] < N) & (offs_k[None, :] < K), other=0.0)
        w1 = tl.load(w_ptr + offs_n[:, None] * stride_wn + BLOCK_K + offs_k[None, :],
                     mask=(offs_n[:, None] < N) & (BLOCK_K + offs_k[None, :] < K), other=0.0)
    if PDL:
        if not LATE:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if PRE:
        x0 = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                     mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
        x1 = tl.load(x_ptr + offs_m[:, None] * stride_xm + BLOCK_K + offs_k[None, :],
                     mask=(offs_m[:, None] < M) & (BLOCK_K + offs_k[None, :] < K), other=0.0)
        acc += tl.dot(x0, tl.trans(w0))
        acc += tl.dot(x1, tl.trans(w1))
        k_begin = 2 * BLOCK_K
    for k0 in range(k_begin, K, BLOCK_K):
        kk = k0 + offs_k
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                     mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        wt = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :],
                     mask=(offs_n[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += tl.dot(xt, tl.trans(wt))
    if PDL:
        if LATE:
            tl.extra.cuda.gdc_launch_dependents()
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemv(x, w, y, variant, block_n=16, block_k=256, warps=4, stages=4):
    m, k = x.shape
    n = w.shape[0]
    pdl = variant != "plain"
    _gemv[(triton.cdiv(n, block_n),)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                      BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, PDL=pdl, PRE=variant.startswith("pre"), LATE=variant.endswith("late"),
                                      num_warps=warps, num_stages=stages, launch_pdl=pdl)


def chain(dims, reps, variant, cfg):
    """dims: feature sizes d0 -> d1 -> ... -> d0, repeated `reps` times (8 weight sets cycled)."""
    torch.manual_seed(0)
    ws = [[torch.randn(dims[i + 1], dims[i], device="cuda", dtype=torch.bfloat16) / 64 for _ in range(8)]
          for i in range(len(dims) - 1)]
    bufs = [torch.randn(1, d, device="cuda", dtype=torch.bfloat16) for d in dims]
    nbytes = 0

    def run():
        for r in range(reps):
            for i in range(len(dims) - 1):
                w = ws[i][r % 8]
                if variant == "cublas":
                    torch.nn.functional.linear(bufs[i], w, out=bufs[i + 1])
                else:
                    gemv(bufs[i], w, bufs[i + 1], variant, *cfg)

    for i in range(len(dims) - 1):
        nbytes += reps * dims[i] * dims[i + 1] * 2
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        run()
    torch.cuda.synchronize()
    ref = None
    g.replay()
    torch.cuda.synchronize()
    ref = bufs[-1].float().clone()
    ms = do_bench(g.replay, warmup=5, rep=40, return_mode="median")
    n_kernels = reps * (len(dims) - 1)
    return ms, nbytes, n_kernels, ref


rows = []
for name, dims, reps, cfg in [
    ("o 4096x4096", [4096, 4096], 64, (16, 256, 4, 4)),
    ("mlp 4096<->14336", [4096, 14336, 4096], 32, (32, 256, 4, 4)),
    ("qkv-like 4096->6144->4096", [4096, 6144, 4096], 32, (16, 256, 4, 4)),
]:
    base = None
    for variant in ("cublas", "plain", "pdl", "pre", "pdl-late", "pre-late"):
        try:
            ms, nbytes, nk, ref = chain(dims, reps, variant, cfg)
        except Exception as ex:  # noqa: BLE001
            rows.append((name, variant, float("nan"), 0, 0, f"failed: {type(ex).__name__}: {str(ex)[:120]}"))
            continue
        agree = ""
        if variant != "cublas":
            if base is None:
                base = ref
            else:
                agree = f"same output as plain: {torch.equal(ref, base)}"
        rows.append((name, variant, ms * 1e3 / nk, nbytes / ms / 1e6, nk, agree))
print(f"\n{'chain':28s} {'variant':8s} {'us/GEMV':>8s} {'GB/s':>6s} {'n':>4s}")
for r in rows:
    print(f"{r[0]:28s} {r[1]:8s} {r[2]:8.2f} {r[3]:6.0f} {r[4]:4d} {r[5]}")
