from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from pageflash.layers import triton_kernel


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding gate then up; returns silu(gate) * up: [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _fused_kernel() -> Optional[Callable]:
    """The Triton kernel, imported on first use (None where triton is missing)."""
    return triton_kernel("pageflash.kernels.activation", "silu_and_mul")


def _use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and _fused_kernel() is not None


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding gate then up; returns silu(gate) * up: [..., I].

    On CUDA one fused Triton kernel (pageflash.kernels.activation); elsewhere silu_and_mul_ref. Both
    compute the same operations in the same order."""
    if _use_fused(x) and x.stride(-1) == 1:
        lead = x.shape[:-1]
        out = _fused_kernel()(x.reshape(-1, x.shape[-1]))
        return out.view(*lead, out.shape[-1])
    return silu_and_mul_ref(x)
