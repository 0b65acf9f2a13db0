"""Model layers: each runs its Triton kernel on CUDA where one applies, else a PyTorch reference."""

from __future__ import annotations

import functools
import importlib
from typing import Callable, Optional


@functools.lru_cache(maxsize=None)
def triton_kernel(module: str, name: str) -> Optional[Callable]:
    """``module.name`` (a Triton kernel wrapper in pageflash.kernels), imported on first use; None where
    triton is missing, so that the layers fall back to their references."""
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:
        return None
