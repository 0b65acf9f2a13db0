"""Mixture of experts: a router picks the top-k experts of each token, their outputs are summed with
the routing weights (Mixtral, Qwen2-MoE, Qwen3-MoE).

Experts are held fused, as transformers >= 5 holds them: ``w13`` [E, 2I, H] (each expert's gate rows,
then its up rows) and ``w2`` [E, H, I]; the checkpoint's per-expert tensors are loaded into their slices.
On CUDA the experts run as two grouped GEMMs over the tokens sorted by expert (kernels/fused_moe.py,
static shapes, so decode steps are captured in CUDA graphs with them); elsewhere the reference loops
over the experts that have tokens, as transformers does.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pageflash.layers import triton_kernel
from pageflash.layers.linear import Linear, check_quantization_method, quantize_weight


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]): softmax over all experts in float32, the top k,
    renormalized to sum to 1 when asked (transformers' order of operations)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, w13_scale: Optional[torch.Tensor] = None,
                w2_scale: Optional[torch.Tensor] = None, w8a8: bool = False) -> torch.Tensor:
    """The routed experts' weighted sum, expert by expert (only experts with tokens run): [T, H] in x's
    dtype. w13_scale / w2_scale: INT8 or e4m3 experts (codes * scale per row, dequantized to x's dtype).
    w8a8 (e4m3 experts): the W8A8 products instead, as kernels/fused_moe.py's -- x's rows and the SiLU's
    output rows quantized per row, each product fp8_linear.fp8_scaled_mm_ref (codes times codes in
    float32, times both scales, rounded to x's dtype)."""
    from pageflash.layers.activation import silu_and_mul_ref

    if w8a8:
        from pageflash.kernels.fp8_linear import fp8_scaled_mm_ref  # (rows quantized on their own: per token)

    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()  # host sync: this path is eager only
    start = 0
    k = ids.shape[1]
    for e, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        tok = pairs // k
        a, b = w13[e], w2[e]
        if w8a8:
            h = silu_and_mul_ref(fp8_scaled_mm_ref(x[tok], a, w13_scale[e]))
            y = fp8_scaled_mm_ref(h, b, w2_scale[e])
            out.index_add_(0, tok, y.float() * weights.reshape(-1)[pairs, None])
            continue
        if w13_scale is not None:
            a = (a.float() * w13_scale[e][:, None]).to(x.dtype)
            b = (b.float() * w2_scale[e][:, None]).to(x.dtype)
        h = silu_and_mul_ref(F.linear(x[tok], a))
        y = F.linear(h, b)
        out.index_add_(0, tok, y.float() * weights.reshape(-1)[pairs, None])
    return out.to(x.dtype)


def _fused() -> Optional[Callable]:
    return triton_kernel("pageflash.kernels.fused_moe", "routed_moe")


def routed_experts(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   top_k: int, renormalize: bool, w13_scale: Optional[torch.Tensor] = None,
                   w2_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """route() then the routed experts' weighted sum: on CUDA the fused kernels (kernels/fused_moe.py:
    routing and grouping in one or two launches, two grouped GEMMs), elsewhere route() and experts_ref."""
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16, torch.float32) and _fused() is not None:
        return _fused()(x.contiguous(), router_logits, w13, w2, top_k, renormalize,
                        w13_scale=w13_scale, w2_scale=w2_scale)
    weights, ids = route(router_logits, top_k, renormalize)
    return experts_ref(x, w13, w2, weights, ids, w13_scale, w2_scale)


class SparseMoE(nn.Module):
    """Router (gate: [E, H], never quantized), routed experts (w13, w2) and, for Qwen2-MoE, a shared
    expert whose output is scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, shared_expert: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        # routing decides which weights run: kept exact (as vLLM does)
        self.gate = Linear(hidden_size, num_experts, quantizable=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)
        # float32 [E, 2I] / [E, H] once quantized: w13 / w2 then hold int8 codes (one scale per row)
        self.w13_scale: Optional[torch.Tensor]
        self.w2_scale: Optional[torch.Tensor]
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)
        self.shared_expert = shared_expert  # a dense MLP module (Qwen2-MoE), or None
        self.shared_expert_gate = None
        if shared_expert is not None:
            self.shared_expert_gate = Linear(hidden_size, 1, quantizable=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = routed_experts(x, self.gate(x), self.w13, self.w2, self.top_k, self.renormalize,
                             self.w13_scale, self.w2_scale)
        if self.shared_expert is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x))
            out = out + gate * self.shared_expert(x)
        return out

    def quantize_(self, method: str) -> None:
        """Quantized experts, in place: int8 (symmetric) or e4m3 ("fp8") codes with a float32 scale per
        row of each expert's matrices (as Linear.quantize_ does per output feature), read weight-only by
        the grouped GEMMs. The router stays exact."""
        check_quantization_method(method)
        if self.w13_scale is not None:
            raise ValueError("these experts are already quantized")
        for name in ("w13", "w2"):
            w = getattr(self, name).data
            q, sc = quantize_weight(w.reshape(-1, w.shape[-1]), method)
            setattr(self, name, nn.Parameter(q.view(w.shape), requires_grad=False))
            self.register_buffer(f"{name}_scale", sc.view(w.shape[0], w.shape[1]))

    # ---- weights -------------------------------------------------------------------------------
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Optional[str] = None) -> None:
        """shard_id None: the whole fused tensor (transformers >= 5 names: experts.gate_up_proj [E, 2I, H],
        experts.down_proj [E, H, I]); else "e:gate" / "e:up" / "e:down" for one expert's matrix."""
        if self.w13_scale is not None:
            raise ValueError("weights must be loaded before the experts are quantized")
        if shard_id is None:
            if param.shape != loaded.shape:
                raise ValueError(f"expert weight shape mismatch: expected {tuple(param.shape)}, "
                                 f"checkpoint has {tuple(loaded.shape)}")
            param.data.copy_(loaded)
            return
        e_str, part = shard_id.split(":")
        e, i = int(e_str), self.intermediate_size
        if not 0 <= e < self.num_experts:
            raise ValueError(f"checkpoint has expert {e}, but the config has num_experts={self.num_experts}")
        dst = param.data[e, {"gate": slice(0, i), "up": slice(i, None), "down": slice(None)}[part]]
        if dst.shape != loaded.shape:
            raise ValueError(f"expert {e} {part} weight shape mismatch: expected {tuple(dst.shape)}, "
                             f"checkpoint has {tuple(loaded.shape)}")
        dst.copy_(loaded)
