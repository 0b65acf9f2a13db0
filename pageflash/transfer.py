"""Host -> device copies of a step's small inputs that never make the host wait for the GPU.

A ``non_blocking`` copy from *pageable* host memory is not asynchronous: the driver stages it
through its own pinned buffer and may wait for the stream to drain first. In a decode loop that
puts the host behind the GPU at every step: the copies for step N+1 wait for step N's graph to
finish, and the GPU then idles while the host issues the rest of the step (H100, llama-3-8b batch
1: ~90 us per step, scripts/step_timeline.py). Copies from pinned memory are queued and return at
once; PyTorch's caching host allocator keeps each pinned block until the copy that reads it has run,
so a block is never rewritten under a pending copy.

Small copies do not go through that allocator, though: its ``pin_memory()`` took 2-5 ms a call in the
processes of a two-GPU engine (run 47, cProfile of llama-3-8b TP=2 at batch 64: 4 calls a step, the
host blocked while the GPU ran), which left the decode pipeline waiting on the host every step. They
are staged in ``PinnedRing``: one pinned arena allocated once, carved in turn, each piece handed back
once the copy that reads it has run (a CUDA event per copy).
"""

from __future__ import annotations

import collections
import threading
from typing import Optional

import torch

__all__ = ["to_device", "copy_to", "PinnedRing"]


class PinnedRing:
    """A pinned host arena of `capacity` bytes that small host -> device copies are staged in.

    Pieces are carved in order at a running (virtual) offset; the bytes a new piece takes were last
    used by the pieces `capacity` bytes behind it, whose copies must have run: each piece's copy
    records a CUDA event, and a piece waits for the (rare) events still pending over its bytes.
    Pieces never straddle the end of the arena (the tail is skipped). Thread-safe."""

    ALIGN = 64

    def __init__(self, capacity: int = 4 << 20) -> None:
        self.capacity = capacity
        self._buf: Optional[torch.Tensor] = None  # (allocated on first use: pinning needs a CUDA device)
        self._offset = 0  # virtual: bytes handed out so far, skipped tails included
        self._pending: collections.deque = collections.deque()  # (virtual start, event), oldest first
        self._lock = threading.Lock()
        self.waits = 0  # how often a piece waited for a copy (a ring too small for the traffic)

    def fits(self, nbytes: int) -> bool:
        """Whether a piece of nbytes is staged here (larger copies use the caching host allocator)."""
        return nbytes <= self.capacity // 8

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst.copy_(src), non-blocking, for a CUDA dst and a CPU src of <= capacity / 8 bytes, with
        src staged in the arena; the current stream of dst's device runs the copy."""
        n = src.numel() * src.element_size()
        size = -(-max(n, 1) // self.ALIGN) * self.ALIGN
        with self._lock:
            if self._buf is None:
                self._buf = self._allocate()
            start = self._offset
            if start % self.capacity + size > self.capacity:  # skip the tail: pieces are contiguous
                start += self.capacity - start % self.capacity
            self._offset = start + size
            # the pieces whose bytes this one reuses: those starting before start + size - capacity
            pending = self._pending
            while pending and (pending[0][0] < start + size - self.capacity or pending[0][1].query()):
                _, ev = pending.popleft()
                if not ev.query():
                    self.waits += 1
                    ev.synchronize()
            lo = start % self.capacity
            piece = self._buf[lo: lo + n].view(src.dtype).view(src.shape)
            piece.copy_(src)
            dst.copy_(piece, non_blocking=True)
            pending.append((start, self._record(dst.device)))

    def _allocate(self) -> torch.Tensor:
        return torch.empty(self.capacity, dtype=torch.uint8, pin_memory=True)

    def _record(self, device: torch.device):
        """An event after the copy just queued on device's current stream (query / synchronize)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return ev


_RING = PinnedRing()


def _staged(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy src into CUDA dst through the ring (False: not a ring copy: too large, or a graph capture,
    whose memcpy nodes must read memory that stays theirs)."""
    if not _RING.fits(src.numel() * src.element_size()) or torch.cuda.is_current_stream_capturing():
        return False
    if src.numel() == 0:
        return True
    _RING.copy(dst, src if src.is_contiguous() else src.contiguous())
    return True


def to_device(t: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """t (a CPU tensor) on device (None: where it is); on CUDA through pinned memory, without
    waiting for the stream."""
    if device is None:
        return t
    if torch.device(device).type != "cuda":
        return t.to(device)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    if not _staged(out, t):
        out.copy_(t.pin_memory(), non_blocking=True)
    return out


def copy_to(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a CPU src; into a CUDA dst through pinned memory, without waiting."""
    if dst.is_cuda:
        if dst.dtype != src.dtype or dst.shape != src.shape or not dst.is_contiguous() or not _staged(dst, src):
            dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
