"""Linear layers as small classes, each parameter with its own weight loader.

Tensor parallelism will swap these per module: a loader knows which slice of a checkpoint tensor it
takes (today: the whole tensor, or one shard of a merged projection). Quantized weights are a state
of the same module: ``Linear.quantize_("int8")`` replaces its loaded weight by int8 codes and a
per-row scale (weight-only INT8, kernels/w8_linear.py), ``"fp8"`` by e4m3 codes and a per-row scale
(kernels/fp8_linear.py); forward then reads the codes.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn


_SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def _skinny_enabled() -> bool:
    import os

    return os.environ.get("PAGEFLASH_SKINNY_GEMM", "1") != "0"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, large: bool = False,
           float_out: bool = False, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x W^T (+ b). Decode-sized products on CUDA (<= 16 rows, 16-bit) go to the faster of cuBLAS and a
    Triton skinny GEMM, timed once per shape; large=True times it for weights past the skinny
    dispatch's size limit too (the LM head). float_out: the result as float32 (the product rounded
    to x's dtype, then widened: what ``.float()`` of it gives), written so by the GEMV directly.
    scale: float32 [N] when weight holds INT8 or e4m3 codes (W = weight * scale[:, None]): the INT8 /
    FP8 kernels."""
    if scale is not None:
        if weight.dtype == torch.float8_e4m3fn:
            from pageflash.kernels.fp8_linear import fp8_linear

            return fp8_linear(x, weight, scale, bias, float_out)
        from pageflash.kernels.w8_linear import w8_linear

        return w8_linear(x, weight, scale, bias, float_out)
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= 16 and x.dtype in _SKINNY_DTYPES and _skinny_enabled():
        from pageflash.kernels.skinny_gemm import maybe_skinny_linear

        # with a bias the sum is rounded in x's dtype first, as F.linear's would be
        y = maybe_skinny_linear(x, weight, large, torch.float32 if float_out and bias is None else None)
        if y is not None:
            y = y if bias is None else y + bias
            return y.float() if float_out else y
    y = F.linear(x, weight, bias)
    return y.float() if float_out else y


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, scale: Optional[torch.Tensor] = None,
                 act: str = "silu") -> Optional[torch.Tensor]:
    """act(x gate^T) * (x up^T) of a fused [gate; up] weight (act: "silu", or Gemma's
    "gelu_pytorch_tanh") in one kernel where that is the decode
    fast path (CUDA, one 16-bit row, the GEMV chosen for this shape: kernels/gemv.py); None elsewhere:
    the caller runs the product, then silu_and_mul. PAGEFLASH_GEMV_SILU=0 turns it off.
    scale (INT8 codes): always None. The GEMV can fuse the SiLU over int8 rows too, but its 16-row
    programs (a gate and an up group) ran W-decode1 at 267.8 tok/s against 269.3-269.4 for the plain
    8-row INT8 GEMV plus the SiLU kernel (docs/BENCHMARKS.md run 29)."""
    import os

    if scale is not None or os.environ.get("PAGEFLASH_GEMV_SILU", "1") == "0":
        return None
    if x.is_cuda and x.dim() == 2 and x.shape[0] == 1 and x.dtype in _SKINNY_DTYPES and _skinny_enabled():
        from pageflash.kernels.skinny_gemm import maybe_gate_up_silu

        return maybe_gate_up_silu(x, weight, act)
    return None


# "int8": weight-only INT8 (kernels/w8_linear.py); "fp8": e4m3 weights, W8A8 on FP8 tensor cores for
# larger products (kernels/fp8_linear.py), as vLLM's dynamic "fp8"
QUANTIZATION_METHODS = ("int8", "fp8")


def quantize_weight(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, float32 scale per row) of a 2-D weight for a quantization method."""
    check_quantization_method(method)
    if method == "fp8":
        from pageflash.kernels.fp8_linear import quantize_fp8

        return quantize_fp8(w)
    from pageflash.kernels.w8_linear import quantize_int8

    return quantize_int8(w)


def check_quantization_method(method: str) -> None:
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_METHODS)}, got {method!r}")


class Linear(nn.Module):
    """y = x W^T (+ b). weight: [out_features, in_features]. quantizable=False: the model's quantize_
    leaves it in its dtype (MoE routers and gates). ``lora``: the LoRA slot weights (lora/layers.py)
    when the model serves adapters: each token's adapter delta is added to y (after the quantized
    base's product too)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, quantizable: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quantizable = quantizable
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.weight_scale: Optional[torch.Tensor]  # float32 [out] once quantized: weight then holds int8 codes
        self.register_buffer("weight_scale", None)
        self.lora: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features]; or, where takes_fp8_rows(x) said so, x's rows quantized already (an
        Fp8Rows from the launch that computed them)."""
        if self.lora is None:
            return linear(x, self.weight, self.bias, scale=self.weight_scale)
        if self.weight_scale is None:
            y = self.lora.fused_gemv(x, self.weight)  # (one row: the delta in the GEMV's launch)
            if y is not None:
                return y if self.bias is None else y + self.bias
        pending = self.lora.shrink(x)  # (before the base product: a graph runs the two side by side)
        y = linear(x, self.weight, self.bias, scale=self.weight_scale)
        self.lora.expand_(pending, y)
        return y

    def takes_fp8_rows(self, x: torch.Tensor) -> bool:
        """Whether forward(x) would quantize x's rows to e4m3 for a W8A8 product (an "fp8" layer
        without LoRA, on CUDA: kernels/fp8_linear.py), so that the launch computing x may hand it
        those rows quantized instead (kernels.fp8_quant.Fp8Rows: the RMSNorm before q/k/v and
        gate/up, the SiLU-and-mul before down). x: the activations, or anything of their shape, dtype
        and device."""
        if self.lora is not None or self.weight_scale is None or self.weight.dtype != torch.float8_e4m3fn \
                or x.device.type != "cuda":
            return False
        from pageflash.kernels.fp8_linear import takes_fp8_rows

        return takes_fp8_rows(x, self.weight)

    def quantize_(self, method: str) -> None:
        """Replace the loaded weight by its quantized form, in place (method: QUANTIZATION_METHODS).
        "int8": symmetric per-row int8 codes and a float32 scale per output feature; "fp8": e4m3 codes
        and a float32 scale per output feature."""
        check_quantization_method(method)
        if self.weight_scale is not None:
            raise ValueError("this linear layer is already quantized")
        q, s = quantize_weight(self.weight.data, method)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", s)

    def load_fp8_(self, codes: torch.Tensor, scale: torch.Tensor, shard_id: Optional[str] = None) -> None:
        """An FP8 checkpoint's e4m3 codes [rows, K] and their float32 scale per row [rows] into the
        weight rows of shard_id (None: all): the layer takes the "fp8" state (e4m3 weight, weight_scale)
        at the first call, as quantize_("fp8") would leave it (model/fp8_checkpoint.py)."""
        fp8 = torch.float8_e4m3fn
        if self.weight.dtype != fp8:
            if self.weight_scale is not None:
                raise ValueError("this linear layer is already quantized")
            dev = self.weight.device
            self.weight = nn.Parameter(torch.zeros(self.weight.shape, dtype=fp8, device=dev), requires_grad=False)
            self.register_buffer("weight_scale", torch.ones(self.weight.shape[0], dtype=torch.float32, device=dev))
        offsets = getattr(self, "shard_offsets", {})
        off, size = (0, self.weight.shape[0]) if shard_id is None else offsets[shard_id]
        dst = self.weight.data.narrow(0, off, size)
        if dst.shape != codes.shape or codes.dtype != fp8 or scale.shape != (size,):
            raise ValueError(f"FP8 weight shape mismatch{'' if shard_id is None else f' for shard {shard_id!r}'}: "
                             f"expected {tuple(dst.shape)} e4m3 codes and [{size}] scales, checkpoint has "
                             f"{tuple(codes.shape)} {codes.dtype} and {tuple(scale.shape)}")
        dst.copy_(codes)
        self.weight_scale.narrow(0, off, size).copy_(scale)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[str] = None) -> None:
        if param is self.weight and getattr(self, "weight_scale", None) is not None:
            raise ValueError("weights must be loaded before the layer is quantized")
        if param.shape != loaded.shape:
            raise ValueError(f"weight shape mismatch: expected {tuple(param.shape)}, checkpoint has {tuple(loaded.shape)}")
        param.data.copy_(loaded)


class MergedLinear(Linear):
    """Several projections of the same input fused into one GEMM (q/k/v, or gate/up).

    shard_sizes: output rows of each shard, in order; shard_ids name them (e.g. "q", "k", "v").
    """

    def __init__(self, in_features: int, shard_sizes: Sequence[int], shard_ids: Sequence[str], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for sid, size in zip(shard_ids, shard_sizes):
            self.shard_offsets[sid] = (off, size)
            off += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[str] = None) -> None:
        if shard_id is None or (param is self.weight and self.weight_scale is not None):
            return super().weight_loader(param, loaded)  # (the latter: to refuse it)
        off, size = self.shard_offsets[shard_id]
        dst = param.data.narrow(0, off, size)
        if dst.shape != loaded.shape:
            raise ValueError(
                f"weight shape mismatch for shard {shard_id!r}: expected {tuple(dst.shape)}, checkpoint has {tuple(loaded.shape)}"
            )
        dst.copy_(loaded)

    def split(self, y: torch.Tensor) -> list[torch.Tensor]:
        return list(y.split([size for _, size in self.shard_offsets.values()], dim=-1))


class QKVLinear(MergedLinear):
    def __init__(self, hidden_size: int, q_size: int, kv_size: int, bias: bool = False) -> None:
        super().__init__(hidden_size, [q_size, kv_size, kv_size], ["q", "k", "v"], bias)


class GateUpLinear(MergedLinear):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(hidden_size, [intermediate_size, intermediate_size], ["gate", "up"], bias=False)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab_size, hidden_size]; also the LM head when embeddings are tied."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    weight_loader = Linear.weight_loader
