from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from pageflash.config import ModelConfig, rope_inv_freq
from pageflash.layers import triton_kernel


def _fused_kernel() -> Optional[Callable]:
    """The Triton kernel, imported on first use (None where triton is missing)."""
    return triton_kernel("pageflash.kernels.rotary", "apply_rotary")


def _use_fused(q: torch.Tensor, k: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and q.dim() == 3
        and k.dim() == 3
        and q.dtype == k.dtype
        and q.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and _fused_kernel() is not None
    )


class RotaryEmbedding(nn.Module):
    """Rotary position embedding, HF/NeoX layout (rotate halves), with a precomputed cos/sin table.

    The table ([max_positions, head_dim // 2] each, float32) is built the way transformers builds it,
    in float32, so that greedy outputs match it bit for bit as far as possible.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, local: bool = False) -> None:
        """local: Gemma 3's sliding layers' table (base rope_local_theta, no scaling)."""
        super().__init__()
        inv = rope_inv_freq(cfg, local).float()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def fusable(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether q, k go through the Triton rotary kernel (which an attention backend may fuse
        with its cache store, given (positions, cos, sin))."""
        return _use_fused(q, k)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64; q: [T, Hq, D]; k: [T, Hkv, D]. Returns rotated (q, k) in their dtype.

        On CUDA one Triton kernel (pageflash.kernels.rotary) rotates q and k IN PLACE and returns them
        (same arithmetic as below, bitwise equal); elsewhere new tensors are returned."""
        if _use_fused(q, k):
            return _fused_kernel()(q, k, positions, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dtype = x.dtype
    cos, sin = cos.to(dtype), sin.to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
