"""The LoRA GEMV's scratch (kernels/gemv.py ``lora=``), sized without Triton: lora/layers.py allocates
it where Triton may be missing (the layers then run the references and never launch the kernel)."""

from __future__ import annotations

import torch

from pageflash.kernels.host_math import cdiv

__all__ = ["LORA_CHUNK", "lora_max_chunks", "gemv_lora_scratch"]

# the LoRA GEMV's chunk: about this many output features share a counter and a LoRA program
LORA_CHUNK = 128


def lora_max_chunks(n_out: int, chunk: int = LORA_CHUNK) -> int:
    """The most chunks a LoRA GEMV of n_out output features can have, whatever its rows per program:
    a chunk holds floor(chunk / per) programs of per features (at least one), more than chunk / 2."""
    return cdiv(n_out, max(1, chunk // 2))


def gemv_lora_scratch(w_rows: int, n_slices: int, rank: int, gate_up: bool, dtype: torch.dtype,
                      device, chunk: int = LORA_CHUNK) -> tuple:
    """(p, counters, gu) for GemvLoRA: the scratch of one projection's LoRA GEMV launches (w_rows rows
    of W, n_slices slices of the adapter's rank), sized for any tile; gu (dtype) only where the
    launches may be gate/up ones (silu_mul)."""
    return (torch.zeros(n_slices * rank, dtype=torch.float32, device=device),
            torch.zeros(1 + lora_max_chunks(w_rows, chunk), dtype=torch.int32, device=device),
            torch.empty(w_rows, dtype=dtype, device=device) if gate_up else None)
