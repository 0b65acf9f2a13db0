"""Checkpoints whose weights are already FP8 (float8 e4m3 codes with float32 scales).

Two ``quantization_config`` forms name them (config.json):
- ``{"quant_method": "fp8", ...}`` (transformers' / vLLM's Fp8Config): ``X.weight`` e4m3 codes with
  ``X.weight_scale`` (one per tensor), or ``X.weight_scale_inv`` per ``weight_block_size`` block
  (DeepSeek / Qwen FP8 releases); ``X.input_scale`` for static activation scales;
- ``{"quant_method": "compressed-tensors", "format": "float-quantized", ...}`` (llm-compressor's FP8
  and FP8-dynamic): ``X.weight_scale`` per tensor ([1] or a scalar), per output channel ([N, 1]) or
  per block; layers named in ``ignore`` stay in 16-bit.

What the loader makes of them (LlamaForCausalLM.load_weights): the engine runs them as
``quantization="fp8"`` (kernels/fp8_linear.py: one float32 scale per weight row).
- A dense projection whose scale is one per tensor or one per row keeps its codes as they are, the
  scale spread over its rows: bit for bit the checkpoint's weights.
- Block scales, and MoE experts, are dequantized (codes x scale, in the model's dtype) and quantized
  again with a scale per row (one more rounding: a code may move one e4m3 step).
- Static activation scales (``input_scale``) are not used: activations get a dynamic scale per row,
  as for ``quantization="fp8"`` on a 16-bit checkpoint. Weights left in 16-bit stay so.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

FP8 = torch.float8_e4m3fn
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")


def checkpoint_quantization(qc: Any) -> Optional[str]:
    """"fp8" for a quantization_config this loader reads; a ValueError naming any other."""
    method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else "unknown"
    if method == "fp8":
        fmt = qc.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"model config: FP8 checkpoints in {fmt!r} are not supported (e4m3 only)")
        return "fp8"
    if method == "compressed-tensors" and qc.get("format") in ("float-quantized", None):
        groups = qc.get("config_groups") or {}
        ok = bool(groups) and all(
            isinstance(g, dict) and isinstance(g.get("weights"), dict)
            and g["weights"].get("type") == "float" and g["weights"].get("num_bits") == 8
            and g["weights"].get("strategy", "tensor") in ("tensor", "channel", "block")
            for g in groups.values())
        if ok:
            return "fp8"
        method = "compressed-tensors (other than 8-bit float weights)"
    raise ValueError(f"model config: quantized checkpoints ({method}) are not supported; load the unquantized "
                     "(bf16/fp16/fp32) weights, an FP8 checkpoint, or a GGUF file (dequantized on load)")


def per_row_scale(scale: torch.Tensor, rows: int) -> Optional[torch.Tensor]:
    """float32 [rows] when scale is one per tensor or one per row ([rows] / [rows, 1]); None for blocks."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(1).expand(rows).contiguous()
    if s.numel() == rows and (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)):
        return s.reshape(rows).contiguous()
    return None


def dequantize(codes: torch.Tensor, scale: torch.Tensor, name: str) -> torch.Tensor:
    """codes x scale in float32: the scale per tensor, per row, or per block of a 2-D grid
    ([ceil(N / bn), ceil(K / bk)] for an [N, K] weight; experts' [E, ...] tensors block per expert)."""
    c = codes.float()
    s = scale.float()
    if s.numel() == 1:
        return c * s.reshape(())
    if s.dim() == c.dim() - 1 or (s.dim() == c.dim() and s.shape[-1] == 1):
        if s.shape[: c.dim() - 1] == c.shape[:-1]:
            return c * s.reshape(*c.shape[:-1], 1)
    if s.dim() == c.dim() and s.shape[:-2] == c.shape[:-2]:
        n, k = c.shape[-2:]
        bn, bk = -(-n // s.shape[-2]), -(-k // s.shape[-1])
        if -(-n // bn) == s.shape[-2] and -(-k // bk) == s.shape[-1]:
            full = s.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
            return c * full
    raise ValueError(f"checkpoint tensor {name!r}: scale of shape {tuple(scale.shape)} does not fit FP8 codes "
                     f"of shape {tuple(codes.shape)} (one per tensor, per row or per block)")


class Fp8Pairs:
    """Pairs each FP8 weight with its scale as the checkpoint's tensors arrive (in any order); drops
    static input scales. add() returns the pairs it completes: (weight name, codes, scale)."""

    def __init__(self) -> None:
        self.codes: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}

    def wants(self, name: str, tensor: torch.Tensor) -> bool:
        return tensor.dtype == FP8 or name.endswith(SCALE_SUFFIXES)

    def add(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
        if name.endswith(".input_scale"):
            return
        for suffix in SCALE_SUFFIXES:
            if name.endswith(suffix):
                base = name[: -len(suffix)] + ".weight"
                if base in self.scales:
                    raise ValueError(f"checkpoint has two scales for {base!r}")
                self.scales[base] = tensor
                break
        else:
            if not name.endswith(".weight"):
                raise ValueError(f"checkpoint tensor {name!r} holds float8 values but is no weight")
            base = name
            self.codes[base] = tensor
        if base in self.codes and base in self.scales:
            yield base, self.codes.pop(base), self.scales.pop(base)

    def check_done(self) -> None:
        if self.codes:
            raise ValueError(f"checkpoint holds float8 weights without a weight_scale: {sorted(self.codes)[:8]}")
        if self.scales:
            raise ValueError(f"checkpoint holds weight scales for weights that are not float8: {sorted(self.scales)[:8]}")
