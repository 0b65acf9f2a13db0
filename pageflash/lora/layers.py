"""LoRA on the device: stacked slot weights per targeted projection, and each token's delta.

Every targeted projection (q/k/v, o, gate/up, down of each decoder layer; merged ones hold their
parts as slices) gets a ``LoRASlots``: preallocated ``a`` [S, n x rank, in], ``b`` [S, out, rank] and
``scale`` [S, n] float32, S = max_loras + 1, slot 0 all zeros (no adapter). An adapter is copied into
a slot (zero-padded up to the slots' rank) when the scheduler hands it one (lora/manager.py).

Per step, ``LoRAContext.token_slots`` holds each token's slot (a static device buffer: the decode
CUDA graphs read it in place) and ``begin_step`` groups the tokens by slot once, on the device
(``group_by_slot``: a stable argsort and per-slot counts, fixed shapes, no host sync). Each targeted
``Linear`` then adds ``scale * (x @ A^T) @ B^T`` of its token's adapter to its output:
kernels/lora_shrink.py and kernels/lora_expand.py on CUDA, their references on the CPU. The shrink
is issued before the base product (``Linear.forward``); in a captured decode graph it runs on a side
stream beside the base GEMM, and the expand waits for both.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
from torch import nn

from pageflash.envs import int_env
from pageflash.layers import triton_kernel

__all__ = ["LoRAContext", "LoRASlots", "SlotGroups", "group_by_slot", "lora_shrink_ref", "lora_expand_ref"]


class SlotGroups(NamedTuple):
    """A step's tokens grouped by adapter slot: order int64 [T] (token indices, slot by slot, stable),
    counts / starts int32 [S] (each slot's number of tokens and first index in order)."""

    order: torch.Tensor
    counts: torch.Tensor
    starts: torch.Tensor


def group_by_slot(slots: torch.Tensor, num_slots: int) -> SlotGroups:
    """slots int32 [T], values in [0, num_slots) -> SlotGroups. Fixed shapes, no host sync."""
    order = torch.argsort(slots, stable=True)
    counts = torch.zeros(num_slots, dtype=torch.int32, device=slots.device)
    counts.scatter_add_(0, slots.long(), torch.ones_like(slots, dtype=torch.int32))
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    return SlotGroups(order, counts, starts)


class LoRAContext:
    """What every targeted projection of one model shares: the step's per-token slots and their grouping.

    token_slots: int32 [max_tokens] on the device; a step writes its first T entries (0: no adapter),
    then ``begin_step(T)``. ``groups`` is None for a step the host knows has no adapter token (the
    projections then skip LoRA; graphs always take the grouped path). ``kernels``: whether the
    projections run the Triton kernels (None: on CUDA; True also runs them on the CPU, under Triton's
    interpreter: the tests' way to run the GPU path through the engine)."""

    def __init__(self, max_loras: int, max_rank: int, max_tokens: int, device: torch.device) -> None:
        self.num_slots = max_loras + 1
        self.max_rank = max_rank
        self.token_slots = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        self.groups: Optional[SlotGroups] = None
        self.num_tokens = 0
        self.kernels: Optional[bool] = None
        self._side: Optional[torch.cuda.Stream] = None
        self.fork = int_env("PAGEFLASH_LORA_SIDE_STREAM", 1) > 0  # (0: the shrinks stay in line; the A/B)
        # one-row steps: the delta inside the base GEMV's launch (LoRASlots.fused_gemv; 0: the A/B)
        self.fused = int_env("PAGEFLASH_LORA_GEMV", 1) > 0
        # the GEMV tile for fused_gemv off CUDA (tests, under Triton's interpreter; on CUDA the
        # dispatch's choice for the shape): (rows, r, bk, stages, warps), None = not fused there
        self.gemv_tile: Optional[tuple] = None

    def side_stream(self, x: torch.Tensor) -> Optional["torch.cuda.Stream"]:
        """The stream the shrinks go on while a CUDA graph is being captured (None otherwise: eager
        steps keep one stream, where forking would only add host work)."""
        if not (self.fork and x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return None
        if self._side is None:
            self._side = torch.cuda.Stream(x.device)
        return self._side

    def begin_step(self, num_tokens: int, active: bool = True) -> None:
        """Group the first num_tokens token_slots by slot (active=False: the step has no adapter token)."""
        if num_tokens > self.token_slots.shape[0]:
            raise RuntimeError(f"a step of {num_tokens} tokens exceeds the LoRA slot buffer "
                               f"({self.token_slots.shape[0]} tokens)")
        self.num_tokens = num_tokens
        self.groups = group_by_slot(self.token_slots[:num_tokens], self.num_slots) if active else None


class LoRASlots(nn.Module):
    """The LoRA slot weights of one projection y = x W^T with output slices (merged q/k/v: three).

    a [S, n x rank, in], b [S, out, rank] in the model's dtype, scale float32 [S, n]; slot 0 zero."""

    def __init__(self, ctx: LoRAContext, in_features: int, slices: Sequence[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.ctx = ctx
        self.slices = list(slices)
        self.offsets = [sum(self.slices[:i]) for i in range(len(self.slices))]
        s, r = ctx.num_slots, ctx.max_rank
        self.rank = r
        self.register_buffer("a", torch.zeros(s, len(self.slices) * r, in_features, dtype=dtype, device=device))
        self.register_buffer("b", torch.zeros(s, sum(self.slices), r, dtype=dtype, device=device))
        self.register_buffer("scale", torch.zeros(s, len(self.slices), dtype=torch.float32, device=device))
        # fused_gemv's scratch (kernels/gemv_scratch.py): p, the launch's counters (zero between
        # launches) and, for gate/up, the sums before the activation; plain attributes (not state)
        from pageflash.kernels.gemv_scratch import gemv_lora_scratch

        self.gemv_p, self.gemv_counters, self.gemv_gu = gemv_lora_scratch(
            sum(self.slices), len(self.slices), r, len(self.slices) == 2, dtype, device)

    def load(self, slot: int, parts: Sequence[tuple[int, float, torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's parts of this projection into slot: (slice, scale, A [r, in], B [rows, r]);
        slices it does not target stay zero. Copies queue on the stream: a step still running reads
        the slot's old weights before they land."""
        from pageflash.transfer import copy_to

        self.clear(slot)
        r = self.rank
        for i, scale, a, b in parts:
            k = a.shape[0]
            copy_to(self.a[slot, i * r: i * r + k], a.to(self.a.dtype))
            copy_to(self.b[slot, self.offsets[i]: self.offsets[i] + self.slices[i], :k], b.to(self.b.dtype))
            self.scale[slot, i] = scale

    def clear(self, slot: int) -> None:
        """Zero slot's weights and scales (its delta becomes zero)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.scale[slot].zero_()

    def fused_gemv(self, x: torch.Tensor, w: torch.Tensor, act: Optional[str] = None) -> Optional[torch.Tensor]:
        """x W^T plus the token's delta in one GEMV launch (kernels/gemv.py, ``lora=``), for a step of
        one token where the GEMV runs this shape (its timed choice on CUDA; ctx.gemv_tile under the
        interpreter); act ("silu" / "gelu_pytorch_tanh", gate/up only): act(gate) * up of the sums
        with their deltas, as the fused gate/up GEMV. None where it does not apply: the caller runs
        shrink, the product and expand_. Why: at batch 1 a shrink / expand pair costs llama-3-8b
        ~8.7 us a projection of launches and waits, 0.83x the base model's speed (docs/BENCHMARKS.md run 47)."""
        ctx = self.ctx
        if ctx.groups is None or not ctx.fused or x.shape[0] != 1 or x.shape[0] != ctx.num_tokens \
                or w.dtype != x.dtype or ctx.kernels is False or (act is not None and len(self.slices) != 2):
            return None
        gemv = triton_kernel("pageflash.kernels.gemv", "gemv")
        if gemv is None:
            return None
        from pageflash.kernels.gemv import GemvLoRA

        lo = GemvLoRA(self.a, self.b, self.scale, ctx.token_slots[:1], self.gemv_p,
                      self.gemv_counters, self.gemv_gu, tuple(self.slices))
        if x.is_cuda:
            from pageflash.layers.linear import _SKINNY_DTYPES, _skinny_enabled

            if x.dtype not in _SKINNY_DTYPES or not _skinny_enabled():  # where no GEMV runs
                return None
            from pageflash.kernels.skinny_gemm import gemv_config

            cfg = gemv_config(x, w, act, lora=lo)
        else:
            cfg = ctx.gemv_tile if ctx.kernels else None
        if cfg is None:
            return None
        return gemv(x, w, *cfg, silu_mul=act is not None, act=act or "silu", lora=lo)

    def add_(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += each token's adapter delta for x [T, in], in place."""
        self.expand_(self.shrink(x), y)

    def shrink(self, x: torch.Tensor) -> Optional[tuple]:
        """The first half of the delta for x [T, in] (None: the step has no adapter token), for expand_
        to finish once the base product exists. Issued before the base product: inside a CUDA graph
        capture it goes on the context's side stream, so that the graph runs it beside the base GEMM
        instead of after it (a decode step's shrinks are latency-bound: ~6 us each on an H100, run 45)."""
        g = self.ctx.groups
        if g is None:
            return None
        if x.shape[0] != self.ctx.num_tokens:
            raise RuntimeError(f"LoRA: a projection ran on {x.shape[0]} tokens in a step begun for "
                               f"{self.ctx.num_tokens} (LoRAContext.begin_step was not called for it)")
        if self.ctx.kernels or (self.ctx.kernels is None and x.is_cuda):
            shrink = triton_kernel("pageflash.kernels.lora_shrink", "lora_shrink")
            expand = triton_kernel("pageflash.kernels.lora_expand", "lora_expand")
            if shrink is not None and expand is not None:
                side = self.ctx.side_stream(x)
                if side is None:
                    return expand, shrink(x, self.a, self.scale, *g), None
                side.wait_stream(torch.cuda.current_stream(x.device))
                with torch.cuda.stream(side):
                    p = shrink(x, self.a, self.scale, *g)
                return expand, p, side
        return lora_expand_ref, lora_shrink_ref(x, self.a, self.scale, *g), None

    def expand_(self, pending: Optional[tuple], y: torch.Tensor) -> None:
        """y += the delta whose first half shrink returned (pending), in place."""
        if pending is None:
            return
        expand, p, side = pending
        if side is not None:
            torch.cuda.current_stream(y.device).wait_stream(side)
        expand(p, self.b, *self.ctx.groups, y, self.slices)


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, scale: torch.Tensor, order: torch.Tensor,
                    counts: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """kernels/lora_shrink.py's op in plain PyTorch, slot by slot (reads counts on the host): float32
    [1, T, R], zero in the rows of tokens without an adapter. x [T, K], a [S, R, K], scale float32
    [S, n] (R = n x rank), order / counts / starts as SlotGroups."""
    t, r = x.shape[0], a.shape[1]
    rank = r // scale.shape[1]
    p = torch.zeros(1, t, r, dtype=torch.float32, device=x.device)
    for slot, (n, first) in enumerate(zip(counts.tolist(), starts.tolist())):
        if slot == 0 or n == 0:
            continue
        rows = order[first: first + n]
        p[0, rows] = (x[rows].float() @ a[slot].float().t()) * scale[slot].repeat_interleave(rank)
    return p


def lora_expand_ref(p: torch.Tensor, b: torch.Tensor, order: torch.Tensor, counts: torch.Tensor,
                    starts: torch.Tensor, out: torch.Tensor, slices: Sequence[int]) -> torch.Tensor:
    """kernels/lora_expand.py's op in plain PyTorch, slot by slot and slice by slice (reads counts on
    the host): out [T, N] += (sum_k p[k, t, slice i's columns]) @ b[slot, slice i's rows]^T for each
    token of a slot >= 1; p float32 [split_k, T, n x rank], b [S, N, rank]. Returns out."""
    rank = b.shape[2]
    for slot, (n, first) in enumerate(zip(counts.tolist(), starts.tolist())):
        if slot == 0 or n == 0:
            continue
        rows = order[first: first + n]
        s = p[:, rows].sum(0)
        col = 0
        for i, width in enumerate(slices):
            d = s[:, i * rank: (i + 1) * rank].to(b.dtype).float() @ b[slot, col: col + width].float().t()
            out[rows, col: col + width] = (out[rows, col: col + width].float() + d).to(out.dtype)
            col += width
    return out
