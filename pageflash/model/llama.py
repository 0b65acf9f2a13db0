"""Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2, SmolLM3 (NoPE layers), Phi-3,
OLMo 2 (post norms, q/k norms over whole projections);
with mixture-of-experts layers: Mixtral, Qwen2-MoE, Qwen3-MoE; Gemma 1/2/3, whose differences are
ModelConfig flags: GeGLU, (1 + w) norms, scaled embeddings, sandwich norms, softcapping, a local rope
for sliding layers) over a flat varlen token batch.

All sequences of a step are concatenated into one token dimension T; attention goes through the
backend with the step's plan (see pageflash/layers/attention.py), so prefill chunks, decodes and
draft tokens share one forward.
"""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Optional

import torch
from torch import nn

from pageflash.config import ModelConfig
from pageflash.layers import triton_kernel
from pageflash.layers.activation import act_and_mul
from pageflash.layers.attention import AttentionBackend
from pageflash.layers.linear import GateUpLinear, Linear, QKVLinear, VocabEmbedding, gate_up_silu, linear
from pageflash.layers.moe import SparseMoE
from pageflash.layers.norm import RMSNorm, rms_norm_ref
from pageflash.layers.rotary import RotaryEmbedding
from pageflash.model.fp8_checkpoint import Fp8Pairs, dequantize, per_row_scale

if TYPE_CHECKING:
    from pageflash.lora.layers import LoRAContext


class _Prefetching:
    """Mixin: ``self.prefetcher`` (a kernels.prefetch.WeightPrefetcher, set by the runner for decode
    graphs) or None; ``_prefetch(kind, w)`` forks a prefetch of w when there is one."""

    prefetcher = None

    def _prefetch(self, kind: str, w: torch.Tensor) -> None:
        if self.prefetcher is not None:
            self.prefetcher.fork(kind, w)


def _fused_qk_norm(qkv: torch.Tensor, weight: torch.Tensor) -> Optional[Callable]:
    """kernels.rms_norm.qk_rms_norm_ (in place) where it applies (CUDA, the weights in qkv's dtype), else None."""
    if qkv.is_cuda and qkv.dim() == 2 and qkv.stride(-1) == 1 and weight.dtype == qkv.dtype:
        return triton_kernel("pageflash.kernels.rms_norm", "qk_rms_norm_")
    return None


class LlamaAttention(_Prefetching, nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        # sliding-window layers pass the backend their window (and the positions: a token tree's keys
        # sit at their depth, not at their place in the cache)
        self.window = cfg.layer_window(index)
        # SmolLM3's NoPE layers: q and k go to the backend unrotated (no rope= either: the fused
        # rotary-in-store and rotary-in-decode launches then store / attend without rotating)
        self.use_rope = cfg.layer_rope(index)
        self.softcap = cfg.attn_logit_softcapping  # Gemma 2
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.q_size, cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size)
        self.scale = cfg.attn_scale
        # Qwen3, Gemma 3: RMSNorm over each head's q and k (one weight per head dim, shared by the heads);
        # OLMo 2 (qk_norm_full): over the whole q and k projections, before they are split into heads
        off, fw = cfg.norm_unit_offset, cfg.norm_float_weight
        self.qk_norm_full = cfg.qk_norm_full
        q_dim, k_dim = (cfg.q_size, cfg.kv_size) if cfg.qk_norm_full else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, off, fw) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, off, fw) if cfg.qk_norm else None
        self.tp_size = tp_size  # (cfg: this rank's shard; OLMo 2's whole-projection norms then all-reduce)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: tuple[torch.Tensor, ...],
        backend: AttentionBackend,
        plan: Any,
        rope_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """kv_cache: (k_cache, v_cache), or (k_cache, v_cache, k_scale, v_scale) for a quantized cache.
        positions [T]: the tokens' positions (sliding windows, token trees); rope_rows [T]: their rows of
        the rotary tables (RotaryEmbedding.rows; None: the positions)."""
        rows = positions if rope_rows is None else rope_rows
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        fused_qk_norm = _fused_qk_norm(qkv, self.q_norm.weight) \
            if self.q_norm is not None and not self.qk_norm_full else None
        if fused_qk_norm is not None:  # one launch, in place, instead of two copies and two norms
            fused_qk_norm(qkv, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.num_heads,
                          self.num_kv_heads, self.head_dim, unit_offset=self.q_norm.unit_offset)
        q, k, v = self.qkv_proj.split(qkv)
        if self.qk_norm_full:  # OLMo 2: [T, heads * head_dim] rows normed whole (new tensors)
            q, k = (self.q_norm(q), self.k_norm(k)) if self.tp_size == 1 else \
                _full_qk_norms(q, k, self.q_norm, self.k_norm, self.tp_size)
        self._prefetch("o", self.o_proj.weight)  # while attention runs
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and fused_qk_norm is None and not self.qk_norm_full:
            q = self.q_norm(q.reshape(t * self.num_heads, self.head_dim)).view(t, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(t * self.num_kv_heads, self.head_dim)).view(t, self.num_kv_heads, self.head_dim)
        kv_scales = kv_cache[2:] or None
        if not self.use_rope:
            o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], plan, self.scale, kv_scales=kv_scales,
                                window=self.window, positions=positions, softcap=self.softcap)
        elif getattr(backend, "fuses_rope", False) and rotary.fusable(q, k):
            # the backend rotates q and k in the launch that stores k and v in the cache
            o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], plan, self.scale,
                                rope=(rows, rotary.cos, rotary.sin), kv_scales=kv_scales,
                                window=self.window, positions=positions, softcap=self.softcap)
        else:
            q, k = rotary(rows, q, k)
            o = backend.forward(q, k, v, kv_cache[0], kv_cache[1], plan, self.scale, kv_scales=kv_scales,
                                window=self.window, positions=positions, softcap=self.softcap)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class LlamaMLP(_Prefetching, nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        self.act = act  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU: Gemma)
        self.gate_up_proj = GateUpLinear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # decode at batch 1: the activation in the GEMV's epilogue (in a step with LoRA rows, the GEMV
        # that also adds their delta to gate/up before the activation, or none)
        lora = self.gate_up_proj.lora
        if lora is not None and lora.ctx.groups is not None:
            act = None if self.gate_up_proj.weight_scale is not None else \
                lora.fused_gemv(x, self.gate_up_proj.weight, act=self.act)
        else:
            act = gate_up_silu(x, self.gate_up_proj.weight, self.gate_up_proj.weight_scale, self.act)
        if act is None:
            gu = self.gate_up_proj(x)
            self._prefetch("down", self.down_proj.weight)  # while the activation runs
            act = act_and_mul(gu, self.act, quant_for=self.down_proj)  # (FP8 rows for an "fp8" down_proj)
        else:
            self._prefetch("down", self.down_proj.weight)
        return self.down_proj(act)


def _moe_block(cfg: ModelConfig) -> SparseMoE:
    shared = cfg.shared_expert_intermediate_size
    return SparseMoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                     cfg.norm_topk_prob, shared_expert=LlamaMLP(cfg.hidden_size, shared) if shared else None)


@functools.lru_cache(maxsize=None)
def _rounded(v: float, dtype: torch.dtype) -> float:
    """v rounded to dtype (a Python float: multiplying by it computes as by a 0-dim tensor of dtype)."""
    return float(torch.tensor(v, dtype=torch.float64).to(dtype))


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the tensor-parallel ranks, in place (the default process group: engine/parallel.py)."""
    torch.distributed.all_reduce(x)
    return x


def _full_qk_norms(q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm,
                   tp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """OLMo 2's q / k norms over the whole projections when each of tp_size ranks holds a slice of
    them (its heads' columns, and the same slice of the norm weights): the sums of squares of both,
    added up over the ranks in one all-reduce, over tp_size x the slice's width (a KV head replicated
    on r ranks is counted r times, and so is its width), then each norm's own arithmetic over that
    mean of squares (rms_norm_ref)."""
    ss = _all_reduce(torch.stack([q.float().pow(2).sum(-1), k.float().pow(2).sum(-1)], dim=-1))  # [T, 2]
    return tuple(rms_norm_ref(x, n.weight, n.eps, n.unit_offset, n.float_weight,
                              mean_square=ss[:, c: c + 1] / (tp_size * x.shape[-1]))
                 for c, (x, n) in enumerate(((q, q_norm), (k, k_norm))))


class LlamaDecoderLayer(_Prefetching, nn.Module):
    """tp_size > 1: cfg is one rank's shard (ModelConfig.shard); the attention output and the MLP's
    (or MoE block's) are partial sums, added up over the ranks (two all-reduces per layer)."""

    def __init__(self, cfg: ModelConfig, index: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.tp_size = tp_size
        self.self_attn = LlamaAttention(cfg, index, tp_size)
        self.local_rope = cfg.layer_rope_local(index)  # Gemma 3's sliding layers: the model's rotary_local
        self.mlp = _moe_block(cfg) if cfg.is_moe_layer(index) else \
            LlamaMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset,  # noqa: E731
                               cfg.norm_float_weight)
        # OLMo 2 (post_norm): no input norm; post_attention_layernorm and post_feedforward_layernorm
        # norm the attention's and the MLP's outputs before each residual add
        self.post_norm = cfg.post_norm
        if not self.post_norm:
            self.input_layernorm = norm()
        # Llama: the norm before the MLP; Gemma 2/3 (sandwich): the norm of the attention's output, with
        # pre_feedforward_layernorm before the MLP and post_feedforward_layernorm after it
        self.post_attention_layernorm = norm()
        self.residual_scale = cfg.residual_multiplier  # Granite: blocks' outputs scaled before each add
        self.sandwich = cfg.sandwich_norm
        if self.post_norm:
            self.post_feedforward_layernorm = norm()
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, x, residual, positions, rotary, kv_cache, backend, plan, pre=None, rope_rows=None):
        """pre: the previous layer's post_feedforward_layernorm (sandwich norms), applied to x in
        the launch of this layer's input norm; rope_rows: LlamaAttention's. Returns (h, residual): a
        sandwich layer's h is the MLP's output before its post_feedforward_layernorm, which the next
        norm applies (so is an OLMo 2 layer's: _forward_post_norm)."""
        if self.post_norm:
            return self._forward_post_norm(x, residual, positions, rotary, kv_cache, backend, plan, pre, rope_rows)
        self._prefetch("qkv", self.self_attn.qkv_proj.weight)  # while the input norm runs
        # an "fp8" projection's input rows come quantized from the norm's launch (Linear.takes_fp8_rows)
        qkv_proj = self.self_attn.qkv_proj
        mlp_in = self.mlp.gate_up_proj if isinstance(self.mlp, LlamaMLP) else None
        if residual is None:
            residual, h = x, self.input_layernorm(x, quant_for=qkv_proj)
        else:
            h, residual = self.input_layernorm(x, residual, pre=pre, x_scale=self.residual_scale, quant_for=qkv_proj)
        h = self.self_attn(h, positions, rotary, kv_cache, backend, plan, rope_rows)
        if self.tp_size > 1:
            h = _all_reduce(h)
        if isinstance(self.mlp, LlamaMLP):  # (an MoE block's weights depend on the routing)
            self._prefetch("gate_up", self.mlp.gate_up_proj.weight)  # while the post-attention norm runs
        if self.sandwich:  # (the attention output's norm, the add and the MLP's norm: one launch)
            h, residual = self.pre_feedforward_layernorm(h, residual, pre=self.post_attention_layernorm,
                                                         quant_for=mlp_in)
        else:
            h, residual = self.post_attention_layernorm(h, residual, x_scale=self.residual_scale, quant_for=mlp_in)
        h = self.mlp(h)
        # (the caller adds the residual: the next layer's input norm, or the final norm -- and, with
        # sandwich norms, applies post_feedforward_layernorm first, in the same launch)
        return (_all_reduce(h) if self.tp_size > 1 else h), residual

    def _forward_post_norm(self, x, residual, positions, rotary, kv_cache, backend, plan, pre, rope_rows):
        """OLMo 2: x + post_attention_layernorm(attention(x)), then the MLP of that. x and residual as
        forward's: with a residual, x is the previous layer's MLP output, whose norm (pre) is applied
        before it is added. Returns (the MLP's output, before post_feedforward_layernorm; the stream)."""
        if residual is not None:
            x = residual + pre(x)
        self._prefetch("qkv", self.self_attn.qkv_proj.weight)
        h = self.self_attn(x, positions, rotary, kv_cache, backend, plan, rope_rows)
        if self.tp_size > 1:
            h = _all_reduce(h)
        if isinstance(self.mlp, LlamaMLP):
            self._prefetch("gate_up", self.mlp.gate_up_proj.weight)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(x)
        return (_all_reduce(h) if self.tp_size > 1 else h), x


class LlamaForCausalLM(_Prefetching, nn.Module):
    """forward(input_ids [T], positions [T], kv_caches, backend, plan) -> hidden [T, H];
    compute_logits(hidden [N, H]) -> float32 logits [N, V].

    Tensor parallelism (tp_size > 1; cfg = the full config's shard(tp_size)): rank tp_rank holds its
    slice of the q/k/v, gate/up (and each expert's) output rows and of the o / down projections' input
    columns, and the whole embedding table, norms, routers and LM head; load_weights takes its slices of
    the full checkpoint tensors. The hidden states after each layer are the same on every rank."""

    def __init__(self, cfg: ModelConfig, max_positions: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        if not 0 <= tp_rank < tp_size:
            raise ValueError(f"tp_rank={tp_rank} is not a rank of tp_size={tp_size}")
        self.cfg = cfg
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        # Gemma: the embeddings times sqrt(hidden_size), that factor rounded to the model's dtype first
        self.embed_scale = float(cfg.hidden_size) ** 0.5 if cfg.embed_scale else None
        self.embedding_multiplier = cfg.embedding_multiplier  # Granite (not rounded first: transformers' way)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp_size) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset, cfg.norm_float_weight)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size)
        self.lora: Optional[LoRAContext] = None  # once enable_lora has run
        self.lora_targets: list[tuple[int, str, Linear]] = []  # (layer, projection name, module) with LoRA slots
        self.make_rotary(max_positions)

    def make_rotary(self, max_positions: int) -> None:
        """The rotary tables on the current default device: ``rotary``, and ``rotary_local`` (Gemma 3's
        sliding layers' base) or None."""
        self.rotary = RotaryEmbedding(self.cfg, max_positions)
        self.rotary_local = RotaryEmbedding(self.cfg, max_positions, local=True) \
            if any(layer.local_rope for layer in self.layers) else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        plan: Any,
        num_layers: Optional[int] = None,
        rope_rows: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """num_layers < L runs only the first layers (early-exit drafts); the final norm is applied.
        rope_rows [T]: each token's row of the rotary tables (LongRoPE: which factors it rotates with;
        the runner gives each request's, ModelConfig.rope_long_after); None: as one sequence's forward
        (RotaryEmbedding.rows)."""
        rows = self.rotary.rows(positions) if rope_rows is None else rope_rows
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * _rounded(self.embed_scale, x.dtype)
        if self.embedding_multiplier is not None:
            x = x * self.embedding_multiplier
        residual = pre = None
        for i, layer in enumerate(self.layers[: num_layers or len(self.layers)]):
            rotary = self.rotary_local if layer.local_rope else self.rotary
            x, residual = layer(x, residual, positions, rotary, kv_caches[i], backend, plan, pre,
                                None if layer.local_rope else rows)
            pre = layer.post_feedforward_layernorm if layer.sandwich or layer.post_norm else None
        self._prefetch("lm_head", self.head_weight)
        x, _ = self.norm(x, residual, pre=pre, x_scale=self.cfg.residual_multiplier)
        if self.prefetcher is not None:
            self.prefetcher.join()
        return x

    def quantize_(self, method: str, device: Optional[torch.device] = None,
                  only: Optional[set[str]] = None) -> None:
        """Quantize every decoder layer's projections and MoE experts in place (Linear.quantize_,
        SparseMoE.quantize_); the embedding table, the LM head and MoE routers stay in the model's dtype
        (as vLLM's weight-only methods keep them).
        device: move the model there, one decoder layer at a time, each quantized once it arrives (a
        model loaded in host memory then never occupies the device at its unquantized size).
        only: the module names to quantize (an FP8 checkpoint's dequantized ones, ``fp8_requantize``);
        the rest stay as loaded."""
        for i, layer in enumerate(self.layers):
            if device is not None:
                layer.to(device)
            for sub, m in layer.named_modules():
                if only is not None and f"layers.{i}.{sub}" not in only:
                    continue
                if (isinstance(m, Linear) and m.quantizable) or isinstance(m, SparseMoE):
                    m.quantize_(method)
        if device is not None:
            self.to(device)
        if self.embed_tokens.weight.is_cuda:
            torch.cuda.empty_cache()

    def enable_lora(self, max_loras: int, max_rank: int, max_tokens: int) -> LoRAContext:
        """Give every decoder layer's q/k/v, o and (dense) gate/up, down projections LoRA slot weights
        for max_loras adapters of rank <= max_rank (lora/layers.py), on the model's device and dtype;
        returns the context whose token_slots the runner fills (max_tokens: the largest step)."""
        from pageflash.lora.adapter import module_shapes
        from pageflash.lora.layers import LoRAContext, LoRASlots

        if self.tp_size > 1:
            raise ValueError("LoRA adapters with tensor_parallel_size > 1 are not supported")
        w = self.embed_tokens.weight
        ctx = LoRAContext(max_loras, max_rank, max_tokens, w.device)
        for i, layer in enumerate(self.layers):
            mods = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj}
            if isinstance(layer.mlp, LlamaMLP):  # (MoE layers: experts are not LoRA targets)
                mods.update(gate_up_proj=layer.mlp.gate_up_proj, down_proj=layer.mlp.down_proj)
            for name, mod in mods.items():
                in_features, slices = module_shapes(self.cfg, name)
                mod.lora = LoRASlots(ctx, in_features, slices, w.dtype, w.device)
                self.lora_targets.append((i, name, mod))
        self.lora = ctx
        return ctx

    def load_lora(self, slot: int, adapter: Any) -> None:
        """Copy a lora.adapter.LoRAAdapter into slot of every targeted projection (the others' slot
        zeroed)."""
        for i, name, mod in self.lora_targets:
            mod.lora.load(slot, adapter.weights.get((i, name), ()))

    def set_prefetcher(self, prefetcher) -> None:
        """Give every layer the weight prefetcher (None: off)."""
        for m in self.modules():
            if isinstance(m, _Prefetching):
                m.prefetcher = prefetcher

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight [V, H]: the embedding table when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.head_weight, large=True, float_out=True)
        cap = self.cfg.final_logit_softcapping
        if cap is not None:  # Gemma 2: in float32 (transformers: in the model's dtype)
            logits = torch.tanh(logits / cap) * cap
        if self.cfg.logits_scaling is not None:  # Granite (likewise in float32)
            logits = logits / self.cfg.logits_scaling
        return logits

    # ---- weights -------------------------------------------------------------------------------
    # HF checkpoint name -> (our parameter name, shard id of a merged projection)
    _MERGED = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up"),
    }

    _EXPERT_PARTS = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                     "down_proj": "down", "gate_up_proj": "gate_up"}

    def _tp_slice(self, name: str, shard: Optional[str], expert: bool, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of checkpoint tensor t, for our parameter `name` (shard: the merged
        projection's part, or an expert's "e:part"): column-parallel q/k/v, gate/up and each expert's
        gate/up rows (and the q/k/v biases), row-parallel o / down columns; everything else whole."""
        if expert:
            part = shard.split(":")[1] if shard is not None else ("gate_up" if name.endswith("w13") else "down")
            if part == "gate_up":  # fused [E, 2I, H]: this rank's rows of the gate half and of the up half
                gate, up = t.chunk(2, dim=1)
                return torch.cat([self._take(gate, 1, name), self._take(up, 1, name)], dim=1)
            return self._take(t, t.dim() - 1 if part == "down" else t.dim() - 2, name)
        if self.cfg.qk_norm_full and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            # OLMo 2: the whole-projection norms' weights, sliced as the q / k rows they scale
            shard = "q" if name.endswith("q_norm.weight") else "k"
        if shard in ("k", "v") and t.shape[0] // self.cfg.head_dim < self.tp_size:
            # fewer KV heads than ranks (ModelConfig.shard): rank r holds KV head r // (ranks per head)
            d = self.cfg.head_dim
            return t.narrow(0, self.tp_rank // (self.tp_size // (t.shape[0] // d)) * d, d)
        if shard in ("q", "k", "v", "gate", "up"):
            return self._take(t, 0, name)
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return self._take(t, 1, name)
        return t

    def _take(self, t: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        n = t.shape[dim]
        if n % self.tp_size:
            raise ValueError(f"checkpoint tensor for {name!r}: dimension {dim} of size {n} does not split "
                             f"into tensor_parallel_size={self.tp_size} parts")
        k = n // self.tp_size
        return t.narrow(dim, self.tp_rank * k, k)

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Phi-3's fused projections as the separate ones the loader maps: ``self_attn.qkv_proj`` rows
        [q; k; v] and ``mlp.gate_up_proj`` rows [gate; up] (a dense MLP's: MoE experts' fused tensors
        are read as they are)."""
        for name, t in weights:
            if name.endswith(".self_attn.qkv_proj.weight") and t.dim() == 2:
                q = self.cfg.num_attention_heads * self.tp_size * self.cfg.head_dim  # (cfg: this rank's shard)
                kv = (t.shape[0] - q) // 2
                if kv <= 0 or q + 2 * kv != t.shape[0]:
                    raise ValueError(f"checkpoint tensor {name!r}: {t.shape[0]} rows do not split into q ({q}) "
                                     f"and two equal k / v parts")
                base = name[: -len("qkv_proj.weight")]
                yield from ((base + f"{p}_proj.weight", x) for p, x in zip("qkv", t.split([q, kv, kv])))
            elif name.endswith(".mlp.gate_up_proj.weight") and ".experts." not in name and t.dim() == 2:
                base = name[: -len("gate_up_proj.weight")]
                gate, up = t.chunk(2, dim=0)
                yield base + "gate_proj.weight", gate
                yield base + "up_proj.weight", up
            else:
                yield name, t

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], origin: str = "checkpoint") -> set[str]:
        """Load (HF name, tensor) pairs; returns the parameter names that were filled. Raises ValueError
        naming the checkpoint tensors it lacks (origin: how the message names the checkpoint): every
        parameter must be filled, a merged one (q/k/v, gate/up, each expert's gate / up / down) by all
        of its parts -- one arriving does not fill the others' rows."""
        weights = self._split_fused(weights)
        params = dict(self.named_parameters())
        parts: dict[str, set[Optional[str]]] = {}  # parameter -> the parts loaded (None: the whole tensor)
        # FP8 checkpoints (model/fp8_checkpoint.py): each e4m3 weight waits for its scale
        fp8 = Fp8Pairs() if self.cfg.checkpoint_quantization == "fp8" else None
        self.fp8_requantize: set[str] = set()  # modules whose FP8 weights came dequantized (quantize_ again)
        for name, tensor in weights:
            if fp8 is not None and fp8.wants(name, tensor):
                for wname, codes, scale in fp8.add(name, tensor):
                    self._load_one(wname, codes, params, parts, scale)
                continue
            self._load_one(name, tensor, params, parts)
        if fp8 is not None:
            fp8.check_done()
        missing = self._missing_tensors(parts)
        if missing:
            raise ValueError(f"{origin} lacks {len(missing)} tensor(s) the model needs: {missing[:8]}"
                             + (" ..." if len(missing) > 8 else ""))
        return set(parts)

    def _load_one(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                  parts: dict[str, set[Optional[str]]], fp8_scale: Optional[torch.Tensor] = None) -> None:
        """One checkpoint tensor into its parameter (fp8_scale: tensor holds e4m3 codes with this scale)."""
        if "rotary_emb.inv_freq" in name:
            return
        if name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                            "model.multi_modal_projector.")):
            return  # Gemma 3's image encoder (its text decoder alone is run)
        for prefix in ("language_model.model.", "model.language_model.", "language_model."):
            if name.startswith(prefix):  # Gemma 3's image-text checkpoints (older and transformers 5 names)
                name = "model." + name.removeprefix(prefix)
                break
        name = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")  # Mixtral's block name
        if name == "lm_head.weight" and self.lm_head is None:
            return  # tied: the embedding table serves as the head
        shard = None
        m = re.search(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.", name)
        e = re.fullmatch(r"(layers\.\d+\.mlp)\.experts\.(?:(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight"
                         r"|(gate_up_proj|down_proj))", name)
        if e:  # routed experts: per-expert matrices, or transformers >= 5's fused [E, ...] tensors
            part = self._EXPERT_PARTS[e.group(3) or e.group(4)]
            name = f"{e.group(1)}.{'w2' if part == 'down' else 'w13'}"
            shard = f"{e.group(2)}:{part}" if e.group(2) is not None else None
        elif m:
            target, shard = self._MERGED[m.group(1)]
            name = name.replace(f".{m.group(1)}.", f".{target}.")
        if name not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
        owner_name, pname = name.rsplit(".", 1)
        owner = self.get_submodule(owner_name)
        if fp8_scale is not None:
            rows = per_row_scale(fp8_scale, tensor.shape[0]) if e is None and tensor.dim() == 2 else None
            if rows is None or not (isinstance(owner, Linear) and owner.quantizable and owner_name.startswith("layers.")):
                # block scales, experts: dequantized here, quantized per row after loading
                tensor = dequantize(tensor, fp8_scale, name)
                self.fp8_requantize.add(owner_name)
            else:  # one scale per tensor or per row: the codes kept as they are
                if self.tp_size > 1:
                    tensor = self._tp_slice(name, shard, False, tensor)
                    if shard in ("q", "k", "v", "gate", "up"):  # column parallel: this rank's rows
                        rows = self._tp_slice(name, shard, False, rows.view(-1, 1)).reshape(-1)
                owner.load_fp8_(tensor, rows, shard)
                parts.setdefault(name, set()).add(shard)
                return
        if self.tp_size > 1:
            tensor = self._tp_slice(name, shard, e is not None, tensor)
        param = getattr(owner, pname)
        owner.weight_loader(param, tensor.to(param.dtype), shard)
        parts.setdefault(name, set()).add(shard)

    def _missing_tensors(self, parts: dict[str, set[Optional[str]]]) -> list[str]:
        """The checkpoint names (HF's layout for this architecture) of what `parts` leaves unset: whole
        parameters, and the parts of merged ones -- a Phi-3 projection none of whose parts came as its
        fused tensor (qkv_proj, gate_up_proj), Mixtral's experts as w1 / w3 / w2."""
        out: dict[str, None] = {}  # (ordered, without repeats: Phi-3's q, k, v name one fused tensor)
        for name, _ in self.named_parameters():
            got = parts.get(name, set())
            if None in got:
                continue
            owner = self.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(owner, SparseMoE):
                need = [f"{e}:{p}" for e in range(owner.num_experts)
                        for p in (("down",) if name.endswith(".w2") else ("gate", "up"))]
            else:
                need = list(getattr(owner, "shard_offsets", None) or [None])
            for shard in need:
                if shard not in got:
                    out[self._checkpoint_name(name, shard, fused=not got)] = None
        return list(out)

    def _checkpoint_name(self, name: str, shard: Optional[str], fused: bool) -> str:
        """HF's checkpoint name of part `shard` of our parameter `name` (fused: none of its parts came)."""
        if shard is None:
            return name if name == "lm_head.weight" else "model." + name
        if ":" in shard:  # an expert's part
            e, part = shard.split(":")
            mixtral = self.cfg.architecture == "MixtralForCausalLM"
            names = {p: n for n, p in self._EXPERT_PARTS.items() if n.startswith("w") == mixtral}
            block = ".block_sparse_moe." if mixtral else ".mlp."
            return f"model.{name.rsplit('.mlp.', 1)[0]}{block}experts.{e}.{names[part]}.weight"
        if fused and self.cfg.architecture == "Phi3ForCausalLM":
            return "model." + name  # Phi-3's checkpoints hold qkv_proj and gate_up_proj whole
        part = next(n for n, (_, s) in self._MERGED.items() if s == shard)
        return "model." + name.replace(f".{self._MERGED[part][0]}.", f".{part}.")
