from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pageflash.layers import triton_kernel


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding gate then up; returns silu(gate) * up: [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding gate then up; returns gelu(gate, approximate="tanh") * up: [..., I]
    (Gemma's gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


_REFS = {"silu": silu_and_mul_ref, "gelu_pytorch_tanh": gelu_tanh_and_mul_ref}
_KERNELS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


def _fused_kernel(act: str = "silu") -> Optional[Callable]:
    """The Triton kernel, imported on first use (None where triton is missing)."""
    return triton_kernel("pageflash.kernels.activation", _KERNELS[act])


def _use_fused(x: torch.Tensor, act: str = "silu") -> bool:
    return x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and _fused_kernel(act) is not None


def act_and_mul(x: torch.Tensor, act: str = "silu", quant_for: Optional[nn.Module] = None) -> torch.Tensor:
    """x: [..., 2 * I] holding gate then up; returns act(gate) * up: [..., I], act "silu" or
    "gelu_pytorch_tanh" (ModelConfig.hidden_act).

    On CUDA one fused Triton kernel (pageflash.kernels.activation); elsewhere the reference
    (silu_and_mul_ref / gelu_tanh_and_mul_ref). Both compute the same operations in the same order.
    quant_for: the linear layer the result goes to; where it takes FP8 rows of a 2-D x's result
    (Linear.takes_fp8_rows), the kernel returns them (kernels.fp8_quant.Fp8Rows) instead."""
    if _use_fused(x, act) and x.stride(-1) == 1:
        if quant_for is not None and x.dim() == 2 and quant_for.takes_fp8_rows(x[:, : x.shape[1] // 2]):
            from pageflash.kernels.fp8_quant import Fp8Rows

            scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
            return Fp8Rows(_fused_kernel(act)(x, scale_out=scale), scale, x.dtype)
        lead = x.shape[:-1]
        out = _fused_kernel(act)(x.reshape(-1, x.shape[-1]))
        return out.view(*lead, out.shape[-1])
    return _REFS[act](x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """act_and_mul(x, "silu")."""
    return act_and_mul(x, "silu")
