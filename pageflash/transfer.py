"""Host -> device copies of a step's small inputs that never make the host wait for the GPU.

A ``non_blocking`` copy from *pageable* host memory is not asynchronous: the driver stages it
through its own pinned buffer and may wait for the stream to drain first. In a decode loop that
puts the host behind the GPU at every step: the copies for step N+1 wait for step N's graph to
finish, and the GPU then idles while the host issues the rest of the step (H100, llama-3-8b batch
1: ~90 us per step, scripts/step_timeline.py). Copies from pinned memory are queued and return at
once; PyTorch's caching host allocator keeps each pinned block until the copy that reads it has run,
so a block is never rewritten under a pending copy.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["to_device", "copy_to", "HostStage", "h2d"]


def to_device(t: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """t (a CPU tensor) on device (None: where it is); on CUDA through pinned memory, without
    waiting for the stream."""
    if device is None:
        return t
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class HostStage:
    """Persistent host images of a step's inputs, `slots` sets taken in turn, pinned on CUDA.

    A step fills one set in place (numpy views) and copies from it: no host allocation and no
    ``pin_memory()`` per step. Why: on two GPUs, run 49 found ``pin_memory()`` of a step's 131 KB
    block-table image taking 2-15 ms on rank 0 (the GPU idle meanwhile, the other rank waiting in its
    all-reduces: llama-3-8b batch 64 at 12 ms a step instead of 5.3). A set is reused once the copies
    that read it have run: ``done()`` records an event after them, and ``take()`` waits for it (which
    returns at once unless the host is more than ``slots - 1`` steps ahead of the GPU)."""

    def __init__(self, device: torch.device, specs: list[tuple[torch.dtype, int]], slots: int = 3) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.sets = [[torch.zeros(n, dtype=dt, pin_memory=self.cuda) for dt, n in specs] for _ in range(slots)]
        self.events: list[Optional[torch.cuda.Event]] = [None] * slots
        self.i = -1

    def take(self) -> list[torch.Tensor]:
        """The next set's tensors (contents: whatever a step before left), once no copy reads them."""
        self.i = (self.i + 1) % len(self.sets)
        ev = self.events[self.i]
        if ev is not None:
            ev.synchronize()
        return self.sets[self.i]

    def done(self) -> None:
        """After the copies from the set take() gave were queued on the current stream."""
        if self.cuda:
            ev = self.events[self.i] or torch.cuda.Event()
            ev.record()
            self.events[self.i] = ev


def h2d(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) from a HostStage tensor: non-blocking into a CUDA dst."""
    dst.copy_(src, non_blocking=dst.is_cuda)


def copy_to(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a CPU src; into a CUDA dst through pinned memory, without waiting."""
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
