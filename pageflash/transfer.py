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

__all__ = ["to_device", "copy_to"]


def to_device(t: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """t (a CPU tensor) on device (None: where it is); on CUDA through pinned memory, without
    waiting for the stream."""
    if device is None:
        return t
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_to(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a CPU src; into a CUDA dst through pinned memory, without waiting."""
    if dst.is_cuda:
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)
