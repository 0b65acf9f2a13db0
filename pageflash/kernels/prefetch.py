"""Weight prefetch into the L2 cache, on a side stream of a captured decode step.

A batch-1 decode step streams every weight once, but between the GEMMs sit latency-bound kernels
(RMSNorm, rotary + K/V store, the decode attention and its combine, SiLU-and-mul) during which
DRAM is idle. A prefetch kernel launched on a side stream when such a window opens reads the head of
the next GEMM's weight into L2 while the small kernels run; the GEMM then finds those bytes in L2.
Nothing is computed: the kernels only move bytes, so the model's results do not change.

Modes (``l2_prefetch(w, nbytes, mode=...)``):
- ``"bulk"`` (sm_90+): each thread issues one ``cp.async.bulk.prefetch.L2`` over a 16 KB chunk
  (one warp per 32 chunks); the copy engine fetches it, the kernel returns at once.
- ``"line"`` (sm_80+): ``prefetch.global.L2::evict_last`` per 128-byte line.
- ``"load"`` (anywhere, the interpreter included): plain loads, summed into a scratch word per
  program so the loads are kept; the kernel lasts as long as the transfer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pageflash.kernels.host_math import cdiv
from pageflash.kernels.launch import fast_launch

__all__ = ["l2_prefetch", "MODES"]

MODES = ("bulk", "line", "load")
_BULK_CHUNK = 16 * 1024  # bytes per bulk prefetch instruction
_BLOCK = 128  # lanes per program of the line mode


@triton.jit
def _prefetch_bulk_kernel(BASE, NCHUNK, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # lanes past the last chunk repeat the first one (a prefetch's size must be a positive multiple
    # of 16, so they cannot be made empty)
    addr = BASE + tl.where(i < NCHUNK, i, 0).to(tl.int64) * CHUNK
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
        "=r,l,r", [addr, tl.full([BLOCK], CHUNK, tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )


_prefetch_bulk_kernel = fast_launch(_prefetch_bulk_kernel)  # host launches via the cached CompiledKernel


@triton.jit
def _prefetch_line_kernel(BASE, NLINES, BLOCK: tl.constexpr, PER: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * (BLOCK * PER)
    for j in tl.static_range(PER):
        i = start + j * BLOCK + tl.arange(0, BLOCK)
        addr = BASE + tl.where(i < NLINES, i, 0) * 128
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
            "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1,
        )


_prefetch_line_kernel = fast_launch(_prefetch_line_kernel)  # host launches via the cached CompiledKernel


@triton.jit
def _prefetch_load_kernel(W, N, SINK, BLOCK: tl.constexpr, PER: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * (BLOCK * PER)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.range(PER, num_stages=4):
        offs = start + j * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(W + offs, mask=offs < N, other=0.0).to(tl.float32)
    tl.store(SINK + pid, tl.sum(acc, axis=0))


_prefetch_load_kernel = fast_launch(_prefetch_load_kernel)  # host launches via the cached CompiledKernel


_sinks: dict[torch.device, torch.Tensor] = {}


def l2_prefetch(w: torch.Tensor, nbytes: int, mode: str = "bulk", programs: int = 264) -> None:
    """Bring the first min(nbytes, w's size) bytes of the contiguous tensor w into L2 (a hint: the
    hardware may drop it). Launches one small kernel on the current stream."""
    if mode not in MODES:
        raise ValueError(f"l2_prefetch: mode must be one of {MODES}, got {mode!r}")
    if not w.is_contiguous():
        raise ValueError("l2_prefetch: the tensor must be contiguous")
    nbytes = min(int(nbytes), w.numel() * w.element_size())
    if nbytes <= 0:
        return
    if mode == "bulk":
        nchunk = nbytes // _BULK_CHUNK  # whole chunks only: none reaches past w's end
        if nchunk == 0:
            return
        # 32 chunks per program (one warp): the prefetches are spread over many SMs' copy engines
        _prefetch_bulk_kernel[(cdiv(nchunk, 32),)](w.data_ptr(), nchunk, CHUNK=_BULK_CHUNK,
                                                          BLOCK=32, num_warps=1)
    elif mode == "line":
        nlines = cdiv(nbytes, 128)
        per = max(1, cdiv(nlines, programs * _BLOCK))
        _prefetch_line_kernel[(cdiv(nlines, _BLOCK * per),)](w.data_ptr(), nlines, BLOCK=_BLOCK,
                                                                    PER=per, num_warps=4)
    else:
        n = nbytes // w.element_size()
        flat = w.view(-1)
        block = 1024
        per = max(1, cdiv(n, programs * block))
        grid = cdiv(n, block * per)
        sink = _sinks.get(w.device)
        if sink is None or sink.numel() < grid:
            sink = _sinks[w.device] = torch.empty(max(grid, 1024), dtype=torch.float32, device=w.device)
        _prefetch_load_kernel[(grid,)](flat, n, sink, BLOCK=block, PER=per, num_warps=4)


class WeightPrefetcher:
    """Forks prefetches of weights onto a side stream while a decode graph is captured.

    ``sizes`` maps a projection kind ("qkv", "o", "gate_up", "down", "lm_head") to the bytes of its
    weight to prefetch. The model calls ``fork(kind, weight)`` at the start of the latency-bound
    window before that projection and ``join()`` at the end of its forward; outside ``active`` (eager
    steps, prefill) both do nothing. In the captured graph each prefetch is a branch that depends on
    the kernel before the window and on the previous prefetch, and nothing on the main stream waits
    for it until the end of the step.
    """

    def __init__(self, sizes: dict[str, int], mode: str = "bulk", max_batch: int = 1) -> None:
        if mode not in MODES:
            raise ValueError(f"WeightPrefetcher: mode must be one of {MODES}, got {mode!r}")
        self.sizes = {k: int(v) for k, v in sizes.items() if int(v) > 0}
        self.mode = mode
        self.max_batch = max_batch  # the largest decode bucket whose graph prefetches
        self.active = False
        self._stream = None
        self._pending = False

    def fork(self, kind: str, w: torch.Tensor) -> None:
        n = self.sizes.get(kind, 0)
        if not self.active or n <= 0 or not w.is_cuda:
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(w.device)
        cur = torch.cuda.current_stream(w.device)
        self._stream.wait_stream(cur)
        with torch.cuda.stream(self._stream):
            l2_prefetch(w, n, self.mode)
        self._pending = True

    def join(self) -> None:
        if self._pending:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
            self._pending = False


def parse_sizes(spec: str) -> dict[str, int]:
    """"o=24,qkv=8" (MiB) -> {"o": 24 << 20, "qkv": 8 << 20}."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        k, sep, v = part.partition("=")
        if not sep or k.strip() not in ("qkv", "o", "gate_up", "down", "lm_head"):
            raise ValueError(f"prefetch sizes: expected kind=MiB with kind in qkv/o/gate_up/down/lm_head, got {part!r}")
        out[k.strip()] = int(float(v) * (1 << 20))
    return out
