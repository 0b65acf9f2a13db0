from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from pageflash.layers import triton_kernel


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as transformers' LlamaRMSNorm does."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _fused_kernel() -> Optional[Callable]:
    """The Triton kernel, imported on first use (None where triton is missing)."""
    return triton_kernel("pageflash.kernels.rms_norm", "rms_norm")


def _use_fused(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        x.is_cuda
        and x.dim() == 2
        and x.stride(-1) == 1
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and _fused_kernel() is not None
    )


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add: forward(x, residual) -> (normed, x + residual).

    On CUDA, x [T, H]: one Triton kernel (pageflash.kernels.rms_norm) with the reference's arithmetic
    (the sum of squares aside, see there); elsewhere rms_norm_ref. Inputs are never modified.
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if _use_fused(x, self.weight) and (
            residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1)
        ):
            # new tensors for both outputs: the caller may still hold x or residual
            return _fused_kernel()(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps)
        x = x + residual
        return rms_norm_ref(x, self.weight, self.eps), x

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)
