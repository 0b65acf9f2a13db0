"""Rotary position embeddings: the inverse frequencies and cos/sin scale of each rope type (as
transformers 5's modeling_rope_utils computes them), the cos/sin tables, and the rotation.

Types: default, linear, llama3 (Llama 3.1), yarn (Qwen2.5 / Qwen3 long context), dynamic (NTK: its base
rescaled only past max_position_embeddings, which the engine never runs past -- docs/ARCHITECTURE.md),
longrope (Phi-3 / 3.5 / 4-mini: short and long per-frequency factors; the tables hold both). Partial
rotary embeddings (Phi-4-mini): only the first rotary_dim dims of a head rotate (rotate-halves within
them); the rest pass through.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from pageflash.config import ModelConfig
from pageflash.layers import triton_kernel


def rope_inv_freq(cfg: ModelConfig, local: bool = False, long: bool = False) -> torch.Tensor:
    """Inverse frequencies, float32 [rotary_dim // 2], with the config's rope scaling applied, in the
    operations (and float32 roundings) of transformers' _compute_*_parameters, so that greedy outputs
    match it. local: Gemma 3's sliding layers' (base rope_local_theta, no scaling). long: LongRoPE's
    long factors (else its short ones)."""
    dim = cfg.rotary_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    kind = "default" if local else cfg.rope_type
    rs = cfg.rope_scaling or {}
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if kind == "yarn":
        return _yarn_inv_freq(cfg, theta, dim, exponents)
    if kind == "longrope":
        ext = torch.tensor(rs["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext * theta ** exponents)
    if kind == "dynamic":
        # transformers' base at seq_len = max_position_embeddings; it rescales the base only for
        # sequences longer than that, which the engine does not run (ModelConfig.max_context_len)
        factor, n = float(rs["factor"]), cfg.max_position_embeddings
        theta = theta * ((factor * n / n) - (factor - 1)) ** (dim / (dim - 2))
    inv = 1.0 / (theta ** exponents)
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_len = float(cfg.rope_original_max)
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    if cfg.rope_freq_factors is not None and not local:  # a GGUF's llama3 scaling, as llama.cpp applies it
        inv = inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    return inv


def _yarn_factor(cfg: ModelConfig) -> float:
    rs = cfg.rope_scaling or {}
    f = rs.get("factor")
    return float(f) if f is not None else cfg.max_position_embeddings / cfg.rope_original_max


def _yarn_inv_freq(cfg: ModelConfig, base: float, dim: int, exponents: torch.Tensor) -> torch.Tensor:
    """YaRN: interpolated (1 / factor) frequencies below the correction range, extrapolated (as
    trained) above it, a linear ramp between; the range spans the dims that turn beta_slow .. beta_fast
    times over original_max_position_embeddings (floored / ceiled unless truncate is false).
    exponents: rope_inv_freq's arange(0, dim, 2) / dim."""
    rs = cfg.rope_scaling or {}
    factor = _yarn_factor(cfg)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
    orig = cfg.rope_original_max

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** exponents
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_share = 1 - ramp
    return interpolation * (1 - extrapolation_share) + extrapolation * extrapolation_share


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What cos and sin are multiplied by (transformers' attention_scaling): YaRN's mscale (its
    attention_factor, or 0.1 ln(factor) + 1, or the ratio of the mscale / mscale_all_dim forms),
    LongRoPE's sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) with factor =
    max_position_embeddings / original_max_position_embeddings unless given; 1.0 for the others."""
    rs = cfg.rope_scaling or {}
    kind = cfg.rope_type
    if rs.get("attention_factor") is not None and kind in ("yarn", "longrope"):
        return float(rs["attention_factor"])
    if kind == "yarn":
        factor = _yarn_factor(cfg)

        def mscale(scale: float, m: float = 1) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)
    if kind == "longrope":
        orig = cfg.rope_original_max
        factor = rs.get("factor") or cfg.max_position_embeddings / orig
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return 1.0


def _tables(inv: torch.Tensor, max_positions: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_positions, len(inv)] float32: angle p * inv_freq, times the attention factor
    (transformers multiplies in float32 before casting to the activations' dtype; so do the kernels)."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv.float())
    return freqs.cos() * scale, freqs.sin() * scale


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
    """Rotary position embedding, HF/NeoX layout (rotate halves of the first rotary_dim dims), with
    precomputed cos/sin tables ``cos``, ``sin``: float32 [rows, rotary_dim // 2].

    The tables are built the way transformers builds them, in float32, so that greedy outputs match
    it bit for bit as far as possible. A token rotates by its table row: its position, except that
    LongRoPE's tables stack the short factors' rows [0, P) and the long factors' [P, 2P) (P =
    max_positions), and a token rotated with the long ones reads row position + P (``long_offset``;
    which tokens do: ModelConfig.rope_long_after)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, local: bool = False) -> None:
        """local: Gemma 3's sliding layers' table (base rope_local_theta, no scaling)."""
        super().__init__()
        scale = 1.0 if local else rope_attention_factor(cfg)
        cos, sin = _tables(rope_inv_freq(cfg, local), max_positions, scale)
        self.long_offset: Optional[int] = None
        self.long_start = 0
        if not local and cfg.rope_type == "longrope":
            lc, ls = _tables(rope_inv_freq(cfg, long=True), max_positions, scale)
            cos, sin = torch.cat((cos, lc)), torch.cat((sin, ls))
            self.long_offset, self.long_start = max_positions, cfg.rope_long_after
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rows(self, positions: torch.Tensor) -> torch.Tensor:
        """Table rows [T] of one forward over one sequence, as transformers' forward picks them: the
        positions, or with LongRoPE all long rows when a position is past original_max_position_embeddings
        - 1 (no host sync). The engine's runner gives each request's rows instead (ModelRunner.rope_rows)."""
        if self.long_offset is None:
            return positions
        return positions + self.long_offset * (positions >= self.long_start).any()

    def fusable(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether q, k go through the Triton rotary kernel (which an attention backend may fuse
        with its cache store, given (rows, cos, sin))."""
        return _use_fused(q, k)

    def forward(self, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: [T] int64 table rows (``rows(positions)``); q: [T, Hq, D]; k: [T, Hkv, D]. Returns
        rotated (q, k) in their dtype.

        On CUDA one Triton kernel (pageflash.kernels.rotary) rotates q and k IN PLACE and returns them
        (same arithmetic as below, bitwise equal); elsewhere new tensors are returned."""
        if _use_fused(q, k):
            return _fused_kernel()(q, k, rows, self.cos, self.sin)
        cos = self.cos[rows].unsqueeze(1)  # [T, 1, rotary_dim / 2]
        sin = self.sin[rows].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D] rotated by cos, sin [..., R/2] (broadcast): rotate-halves over the first R dims
    (R <= D: partial rotary), the rest unchanged. Each product rounded to x's dtype, as transformers'
    q * cos + rotate_half(q) * sin rounds it."""
    dtype = x.dtype
    rot = 2 * cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((_rotate(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    cos, sin = cos.to(dtype), sin.to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
