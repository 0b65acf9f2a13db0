import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] holding gate then up; returns silu(gate) * up: [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
