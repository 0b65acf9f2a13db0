"""Skinny GEMM for decode: y = x @ W^T with few rows in x (M <= 16), memory-bound on W.

cuBLAS runs the small projections of a decode step (qkv, o_proj at batch 1) as split-K GEMVs at about
half the copy bandwidth on an H100 (docs/BENCHMARKS.md). Here each program owns BLOCK_N output
features and streams their rows of W (contiguous along K) through a pipelined loop, with x padded
to 16 rows for the tensor-core dot; SPLIT_K programs share a row block when N alone gives too few
programs, and their fp32 partials are summed by a second tiny pass.

Which implementation a shape uses is decided once per (N, K, M-bucket) by timing cuBLAS, this
kernel and, at M = 1, the row-streaming GEMV of kernels/gemv.py (`SkinnyDispatch`); the choice is
made during warm-up, so CUDA-graph capture only replays it.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import triton
import triton.language as tl

from pageflash.envs import int_tuple_env
from pageflash.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pageflash.kernels.device_info import high_bandwidth_per_sm, memory_bandwidth_per_sm
from pageflash.kernels.gemv import gemv
from pageflash.kernels.host_math import cdiv
from pageflash.kernels.launch import fast_launch, precompiling


# M is not specialized: one compile per config serves every decode batch size (cold start)
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_ys,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_start = pid_k * k_per
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, tl.minimum(k_start + k_per, K), BLOCK_K):
        kk = k0 + offs_k
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                     mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        wt = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :],
                     mask=(offs_n[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += tl.dot(xt, tl.trans(wt))
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = y_ptr + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


_skinny_kernel = fast_launch(_skinny_kernel)  # host launches via the cached CompiledKernel


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, block_n: int = 16, block_k: int = 256,
                split_k: int = 1, num_warps: int = 4, num_stages: int = 4) -> torch.Tensor:
    """x: [M, K] (M <= 16, rows contiguous), w: [N, K] contiguous, same float dtype. Returns [M, N] in x's dtype."""
    assert x.dim() == 2 and w.dim() == 2, f"expected 2-D x and w, got {tuple(x.shape)} and {tuple(w.shape)}"
    m, k = x.shape
    n, k2 = w.shape
    assert k == k2, f"x has K={k}, w has K={k2}"
    assert m <= 16, f"skinny_gemm is for M <= 16 rows, got {m}"
    assert x.dtype == w.dtype, f"dtype mismatch: x {x.dtype}, w {w.dtype}"
    assert x.stride(1) == 1 and w.stride(1) == 1, "x and w must be contiguous along K"
    grid = (cdiv(n, block_n), split_k)
    if split_k == 1:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        _skinny_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), 0,
                             BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=1,
                             num_warps=num_warps, num_stages=num_stages)
        return y
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    _skinny_kernel[grid](x, w, part, m, n, k, x.stride(0), w.stride(0), part.stride(1), part.stride(0),
                         BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                         num_warps=num_warps, num_stages=num_stages)
    return part.sum(0).to(x.dtype)


def skinny_gemm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().t()).to(x.dtype)


logger = logging.getLogger(__name__)

# configs tried per shape (block_n, block_k, split_k, num_warps, num_stages): the ones that won on an
# H100/H200 for llama-3-8b's qkv and o projections (split-K variants never won; each extra config
# costs a Triton compile at cold start)
_CONFIGS = [(16, 256, 1, 4, 4), (16, 512, 1, 4, 3), (32, 256, 1, 4, 4)]
# The skinny kernel never beat cuBLAS on larger weights (gate_up, down): it is not timed there. The
# LM head is timed (large=True): on an H100 the skinny kernel read llama-3-8b's 1.05 GB head in 354 us
# against cuBLAS's 366-389 us (docs/BENCHMARKS.md).
MAX_WEIGHT_ELEMENTS = 32 * 1024 * 1024
# At M = 1 the row-streaming GEMV (kernels/gemv.py) is timed on every shape: one tile config
# (r, bk, num_stages, num_warps), rows of W per program varied at run time (no extra compile). On an
# H100 in decode-graph chains it beat cuBLAS on gate_up/down and the skinny kernel on qkv/o by 3-6%;
# timed cold, 8 rows per program won on every llama-3-8b shape, and forcing 56 or 64 for gate_up
# made the decode graph slower (docs/BENCHMARKS.md run 17). At M = 1 only the GEMV and cuBLAS are
# timed (run 18: the skinny kernel's cold-timing wins on o did not hold in the graph).
_GEMV_TILE = (4, 512, 4, 4)
# Where the GPU's peak bandwidth per SM exceeds device_info.STAGES_BW_PER_SM (H200: 36 GB/s, H100
# SXM: 25): more bytes in flight per program, 3 stages of 4 x 1024 (24 KiB) instead of 4 of 4 x 512
# (16 KiB), as the decode kernel's second stage there (Little's law). H200, W-decode1: +2.0% tok/s
# (docs/BENCHMARKS.md run 61); the H100 keeps run 17's tile (not re-measured with this one).
_GEMV_TILE_HIGH_BW = (4, 1024, 3, 4)


def gemv_tile(device: Optional[torch.device] = None) -> tuple[int, int, int, int]:
    """The GEMV's tile config (r, bk, num_stages, num_warps) on this CUDA device: PAGEFLASH_GEMV_TILE
    ("r,bk,stages,warps", for A/Bs) if set, else by the device's peak bandwidth per SM: _GEMV_TILE_HIGH_BW
    above STAGES_BW_PER_SM, _GEMV_TILE otherwise (and without a device, or where it is unknown)."""
    forced = int_tuple_env("PAGEFLASH_GEMV_TILE", None, (True, True, False, True))
    if forced:
        return forced
    if device is None or device.type != "cuda":
        return _GEMV_TILE
    high = high_bandwidth_per_sm(memory_bandwidth_per_sm(torch.cuda.get_device_properties(device)))
    return _GEMV_TILE_HIGH_BW if high else _GEMV_TILE


_MARGIN = 0.985  # a candidate must beat the best so far by 1.5% (timed cold, see _bench_cold)


def _gemv_rows(n: int, num_sms: int, r: int = 4) -> list[int]:
    """Rows per program to time, in order: 8 (the winner on every llama-3-8b shape), then about 4
    programs per SM, half and twice that; multiples of the tile's r rows (the GEMV requires it). A
    later one replaces an earlier one only by the margin."""
    def up(v: int) -> int:
        return max(r, -(-v // r) * r)
    base = up(-(-n // (4 * num_sms)))
    return list(dict.fromkeys([up(8), base, up(-(-base // 2)), 2 * base]))


def _bench_cold(fn, flush: torch.Tensor, reps: int = 15) -> float:
    """Median GPU time (ms) of fn with its operands out of L2, as in a decode step where every weight
    is read once. L2 is refilled by *reading* 128 MiB before each call: triton's do_bench zeroes a
    buffer instead, which leaves L2 full of dirty lines whose write-back then competes with the timed
    kernel's reads (a memory-bound GEMV measured that way can look several % slower or faster than
    it runs). flush: the buffer read (its contents do not matter). A spin after the flush keeps the
    GPU behind the host, so that no launch latency is timed."""
    fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        flush.sum()
        torch.cuda._sleep(200_000)  # ~100 us
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in ev)
    return ts[len(ts) // 2]


class SkinnyDispatch:
    """Per (N, K, M <= 16) shape: time cuBLAS, the skinny kernel's configs and (M = 1) the GEMV's row
    counts once, keep the fastest. A choice is None (cuBLAS), ("skinny", cfg) or ("gemv", cfg)."""

    def __init__(self) -> None:
        # (N, K, M, dtype), and (N, K, 1, dtype, act) for the fused gate/up GEMV -> choice
        self.choice: dict[tuple, Optional[tuple]] = {}

    def __call__(self, x: torch.Tensor, w: torch.Tensor, large: bool = False,
                 out_dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
        """The product via the Triton kernel that won for this shape; None = use cuBLAS.
        large: time the skinny kernel on this shape even if its weight exceeds MAX_WEIGHT_ELEMENTS
        (the LM head). out_dtype float32: the GEMV writes the rounded product widened to float32
        itself (no conversion launch); other kernels return x's dtype."""
        m = x.shape[0]
        if w.numel() > MAX_WEIGHT_ELEMENTS and not large and m != 1:
            return None
        c = self._choice(x, w, large)
        if c is None:
            if m == 1 and out_dtype is not None and out_dtype != x.dtype and precompiling():
                out = torch.empty(m, w.shape[0], dtype=out_dtype, device=x.device)
                self._queue_gemv(x, w, out=out)  # the widening GEMV's own compile (the LM head)
            return None
        if c[0] == "gemv":
            out = None
            if out_dtype is not None and out_dtype != x.dtype:
                out = torch.empty(m, w.shape[0], dtype=out_dtype, device=x.device)
            return gemv(x, w, *c[1], out=out)
        return skinny_gemm(x, w, *c[1])

    def gate_up_silu(self, x: torch.Tensor, w: torch.Tensor, act: str = "silu") -> Optional[torch.Tensor]:
        """silu(x gate^T) * (x up^T) for a fused [gate; up] weight w (act="gelu_pytorch_tanh": GELU's
        tanh form instead), through the GEMV with the activation in its epilogue, when that won for this
        shape at one row; None otherwise (the caller runs the product and the activation kernel).
        Its own decision: the fused GEMV's row counts (multiples of 2 r) against what the caller
        would run instead, cuBLAS and the activation kernel. (Deciding by the plain product's choice,
        a process whose cold timings had cuBLAS 1.5% ahead of the plain GEMV on llama-3-8b's gate_up
        ran W-decode1 2.7% slower on the H200: 231 against 237.6 tok/s, docs/BENCHMARKS.md run 61.)"""
        if x.shape[0] != 1:
            return None
        c = self._silu_choice(x, w, act)
        return None if c is None else gemv(x, w, *c[1], silu_mul=True, act=act)

    def _silu_choice(self, x: torch.Tensor, w: torch.Tensor, act: str, lora=None) -> Optional[tuple]:
        key = (w.shape[0], w.shape[1], 1, x.dtype, act)
        if key not in self.choice:
            if torch.cuda.is_current_stream_capturing():
                return None
            if precompiling():
                self._queue_gemv(x, w, silu_mul=True, act=act)
                if lora is not None:
                    self._queue_gemv(x, w, silu_mul=True, act=act, lora=lora)
                return None
            self.choice[key] = self._decide(x, w, skinny=False, act=act)
        return self.choice[key]

    def gemv_config(self, x: torch.Tensor, w: torch.Tensor, act: Optional[str] = None,
                    lora=None) -> Optional[tuple]:
        """The GEMV tile (rows, r, bk, stages, warps) that won for this one-row shape (act: the fused
        gate/up GEMV's decision), or None where cuBLAS won or nothing can be decided now (a capture).
        For the LoRA GEMV (kernels/gemv.py, ``lora=``), which runs the same rows with the delta's
        programs beside them. Under precompile: queues the candidates' compiles (with lora's variant
        too) and returns None."""
        if x.shape[0] != 1:
            return None
        if act is not None:
            c = self._silu_choice(x, w, act, lora)
        else:
            if precompiling() and lora is not None and (w.shape[0], w.shape[1], 1, x.dtype) not in self.choice:
                self._queue_gemv(x, w, lora=lora)
            c = self._choice(x, w, False)
        return c[1] if c is not None and c[0] == "gemv" else None

    def _choice(self, x: torch.Tensor, w: torch.Tensor, large: bool) -> Optional[tuple]:
        key = (w.shape[0], w.shape[1], x.shape[0], x.dtype)
        if key not in self.choice:
            if torch.cuda.is_current_stream_capturing():
                return None  # never time inside a capture: fall back, decide at the next warm-up
            skinny = large or w.numel() <= MAX_WEIGHT_ELEMENTS
            if precompiling():  # kernels only compile now: queue the candidates', decide later
                for kind, cfg in self._candidates(x, w, skinny):
                    if kind != "cublas":
                        try:
                            (gemv if kind == "gemv" else skinny_gemm)(x, w, *cfg)
                        except Exception:  # as _decide: a config this GPU/Triton rejects is skipped
                            pass
                return None
            self.choice[key] = self._decide(x, w, skinny=skinny)
        return self.choice[key]

    def _queue_gemv(self, x: torch.Tensor, w: torch.Tensor, **kw) -> None:
        """Under precompile: the GEMV candidates' launches with these extras (their own compiles)."""
        for kind, cfg in self._candidates(x, w, False, silu=bool(kw.get("silu_mul"))):
            if kind == "gemv":
                try:
                    gemv(x, w, *cfg, **kw)
                except Exception:
                    pass

    @staticmethod
    def _candidates(x: torch.Tensor, w: torch.Tensor, skinny: bool,
                    silu: bool = False) -> list[tuple[str, Optional[tuple]]]:
        """What _decide times, in its order (silu: for the fused gate/up GEMV, whose programs hold a
        gate and an up group: rows a multiple of 2 r)."""
        cands: list[tuple[str, Optional[tuple]]] = []
        if x.shape[0] == 1:
            r, bk, stages, warps = gemv_tile(x.device)
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            rows = _gemv_rows(w.shape[0], sms, 2 * r if silu else r)
            cands += [("gemv", (n, r, bk, stages, warps)) for n in rows]
        cands.append(("cublas", None))
        if skinny and x.shape[0] > 1:
            cands += [("skinny", c) for c in _CONFIGS]
        return cands

    @staticmethod
    def _decide(x: torch.Tensor, w: torch.Tensor, skinny: bool = True, act: Optional[str] = None) -> Optional[tuple]:
        """Time the candidates in a fixed order; the first one is the incumbent and a later one
        replaces the best so far only by the margin. At M = 1 the GEMV goes first, cuBLAS must beat
        it, and the skinny kernel is not timed: timed cold and alone it sometimes beat the GEMV on
        llama-3-8b's o projection by the margin (16.6 vs ~16.9 us), but inside the decode graph it is
        the slower kernel (93-95% of a pure read against 96-98%), and a process that picked it ran
        W-decode1 at 177.5 tok/s against 179.0 (docs/BENCHMARKS.md run 18).

        act ("silu" / "gelu_pytorch_tanh"; M = 1): for gate_up_silu, the fused GEMV (activation in
        its epilogue) against cuBLAS followed by the activation kernel."""
        def cublas():
            y = torch.nn.functional.linear(x, w)
            return y if act is None else (gelu_tanh_and_mul if act == "gelu_pytorch_tanh" else silu_and_mul)(y)

        kw = {} if act is None else dict(silu_mul=True, act=act)
        ref = cublas()
        flush = torch.empty(64 << 20, dtype=torch.float16, device=x.device)  # 128 MiB, freed on return
        cands = SkinnyDispatch._candidates(x, w, skinny, silu=act is not None)
        best, best_t, t_cublas = None, float("inf"), float("nan")
        for kind, cfg in cands:
            try:
                if kind == "cublas":
                    t = t_cublas = _bench_cold(cublas, flush)
                else:
                    fn = gemv if kind == "gemv" else skinny_gemm
                    y = fn(x, w, *cfg, **kw)
                    if not torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=2e-2):
                        continue
                    t = _bench_cold(lambda: fn(x, w, *cfg, **kw), flush)
            except Exception:  # a config that does not compile on this GPU/Triton: skip it
                continue
            # a candidate must beat the best so far by a margin: choices that flip between processes
            # on noise cost more than they save
            if best is None or t < best_t * _MARGIN:
                best_t, best = t, (kind, cfg)
        logger.info("linear %dx%d at M=%d%s: %s %.1f us (cuBLAS %.1f us)", w.shape[0], w.shape[1], x.shape[0],
                    "" if act is None else f" with {act}", best, best_t * 1e3, t_cublas * 1e3)
        return None if best is None or best[0] == "cublas" else best


_DISPATCH: Optional[SkinnyDispatch] = None


def _dispatch() -> SkinnyDispatch:
    global _DISPATCH
    if _DISPATCH is None:
        _DISPATCH = SkinnyDispatch()
    return _DISPATCH


def maybe_skinny_linear(x: torch.Tensor, w: torch.Tensor, large: bool = False,
                        out_dtype: Optional[torch.dtype] = None) -> Optional[torch.Tensor]:
    """Decode-sized bf16/fp16 products on CUDA through the faster of cuBLAS and the skinny kernel, or
    at one row of cuBLAS and the GEMV."""
    return _dispatch()(x, w, large, out_dtype)


def gemv_config(x: torch.Tensor, w: torch.Tensor, act: Optional[str] = None, lora=None) -> Optional[tuple]:
    """SkinnyDispatch.gemv_config of the process's dispatch (the caller checks that the GEMV may run
    at all: layers/linear.py's _skinny_enabled and _SKINNY_DTYPES)."""
    return _dispatch().gemv_config(x, w, act, lora)


def maybe_gate_up_silu(x: torch.Tensor, w: torch.Tensor, act: str = "silu") -> Optional[torch.Tensor]:
    """One row's act(gate) * up of a fused gate/up weight in one GEMV launch, or None (see
    SkinnyDispatch.gate_up_silu)."""
    return _dispatch().gate_up_silu(x, w, act)
