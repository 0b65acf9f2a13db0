"""Helpers of the GEMV probes (scripts/gemv_probe.py, scripts/w8_gemv_probe.py): a CUDA graph of calls
timed per call, and a pure streaming read of a weight's bytes, the ceiling any GEMV over them can reach.
"""

import torch
import triton
import triton.language as tl
from triton.testing import do_bench


@triton.jit
def read_kernel(W, N, SINK, BLOCK: tl.constexpr, PER: tl.constexpr, STAGES: tl.constexpr):
    """Each program reads PER x BLOCK contiguous elements of W (of N) and stores their sum in SINK: float32
    sums of a float W, int32 sums of integer codes (no float conversion in the way of the stream)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * (BLOCK * PER)
    acc_dt = tl.int32 if W.dtype.element_ty.is_int() else tl.float32
    acc = tl.zeros([BLOCK], dtype=acc_dt)
    for j in tl.range(PER, num_stages=STAGES):
        offs = start + j * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(W + offs, mask=offs < N, other=0).to(acc_dt)
    tl.store(SINK + pid, tl.sum(acc, axis=0).to(SINK.dtype.element_ty))


def graph_time(fn, n_calls=32):
    """Microseconds per call of fn(i), i = 0 .. n_calls - 1 captured in one CUDA graph (fn cycles
    through distinct weights, so that every call reads HBM, as in a decode step), median of replays."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        with torch.cuda.graph(g, stream=st):
            for i in range(n_calls):
                fn(i)
    torch.cuda.synchronize()
    return do_bench(g.replay, warmup=5, rep=60, return_mode="median") / n_calls * 1e3
