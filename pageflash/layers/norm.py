from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from pageflash.layers import triton_kernel


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
                 float_weight: bool = False, mean_square: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as transformers' LlamaRMSNorm does; unit_offset: as
    GemmaRMSNorm does, times (1 + weight) in float32, rounded once to x's dtype; float_weight: as
    Olmo2RMSNorm does, times weight in float32, rounded once to x's dtype. mean_square: float32
    [..., 1], the mean of squares to norm by instead of x's own (x a slice of the normed rows:
    tensor-parallel ranks, model/llama.py _full_qk_norms)."""
    dtype = x.dtype
    xf = x.float()
    if mean_square is None:
        mean_square = xf.pow(2).mean(-1, keepdim=True)
    xf = xf * torch.rsqrt(mean_square + eps)
    if float_weight:
        return (weight.float() * xf).to(dtype)
    if unit_offset:
        return (xf * (1.0 + weight.float())).to(dtype)
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

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False, float_weight: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset  # Gemma: scale by (1 + weight); its weights are stored as offsets from 1
        # OLMo 2: weight times the normed x in float32, rounded once (the Triton kernel does not
        # implement it: computed with PyTorch ops on every device)
        self.float_weight = float_weight
        self.weight = nn.Parameter(torch.zeros(hidden_size) if unit_offset else torch.ones(hidden_size),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, pre: Optional["RMSNorm"] = None,
                x_scale: Optional[float] = None, quant_for: Optional[nn.Module] = None):
        """pre (with residual): another norm applied to x first -- pre(x) + residual, normed: Gemma
        2/3's norm of a block's output, the residual add and the next norm, in one launch on CUDA.
        x_scale (with residual): x * x_scale + residual, normed (Granite's residual_multiplier).
        quant_for: the linear layer the output goes to; where it takes FP8 rows
        (Linear.takes_fp8_rows), the launch writes the output's e4m3 codes and row scales
        (kernels.fp8_quant.Fp8Rows) instead of the output."""
        if pre is not None and (residual is None or pre.eps != self.eps or pre.unit_offset != self.unit_offset
                                or pre.float_weight or pre.weight.dtype != self.weight.dtype):
            x, pre = pre(x), None
        if residual is None and x_scale is not None:
            raise ValueError("RMSNorm: x_scale needs a residual")
        if not self.float_weight and _use_fused(x, self.weight) and (
            residual is None or (residual.dtype == x.dtype and residual.stride(-1) == 1)
        ):
            # new tensors for both outputs: the caller may still hold x or residual
            scale_out = None
            if quant_for is not None and (self.unit_offset or self.weight.dtype == x.dtype) \
                    and quant_for.takes_fp8_rows(x):
                scale_out = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
            y = _fused_kernel()(x, self.weight, self.eps, residual, unit_offset=self.unit_offset,
                                pre_weight=None if pre is None else pre.weight, x_scale=x_scale, scale_out=scale_out)
            if scale_out is None:
                return y
            from pageflash.kernels.fp8_quant import Fp8Rows

            if residual is None:
                return Fp8Rows(y, scale_out, x.dtype)
            return Fp8Rows(y[0], scale_out, x.dtype), y[1]
        if pre is not None:
            x = pre(x)
        if residual is None:
            return rms_norm_ref(x, self.weight, self.eps, self.unit_offset, self.float_weight)
        x = (x if x_scale is None else x * x_scale) + residual
        return rms_norm_ref(x, self.weight, self.eps, self.unit_offset, self.float_weight), x

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)
