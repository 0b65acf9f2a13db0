"""Model configuration: a frozen dataclass built from a HF config.json dict or GGUF metadata."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

# architecture -> HF model_type
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                "Qwen3MoeForCausalLM": "qwen3_moe"}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and constants of a Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2),
    and of its mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE: num_experts > 0)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope
    architecture: str = "LlamaForCausalLM"
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # sliding-window attention: a query at position p sees the keys at positions p - sliding_window + 1
    # .. p (transformers' mask); in the layers sliding_layers lists (None: every layer)
    sliding_window: Optional[int] = None
    sliding_layers: Optional[tuple[int, ...]] = None
    # mixture of experts (0 experts: every layer has a dense MLP of intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = True  # renormalize the top-k routing probabilities to sum to 1 (Mixtral, Qwen3-MoE)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"model config: architecture {self.architecture!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if self.num_experts:
            for name in ("num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
                v = getattr(self, name)
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"model config: {name} must be a positive integer for a mixture of experts, got {v!r}")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(f"model config: num_experts_per_tok ({self.num_experts_per_tok}) exceeds "
                                 f"num_experts ({self.num_experts})")
        elif self.architecture in MOE_ARCHITECTURES:
            raise ValueError(f"model config: {self.architecture} needs num_experts > 0")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"model config: sliding_window must be a positive integer or None, got {self.sliding_window!r}")
        if self.sliding_layers is not None and any(
                not isinstance(i, int) or not 0 <= i < self.num_hidden_layers for i in self.sliding_layers):
            raise ValueError(f"model config: sliding_layers must be layer indices in [0, {self.num_hidden_layers}), "
                             f"got {self.sliding_layers!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ("llama3", "linear", "default"):
                raise ValueError(f"model config: rope_scaling type {kind!r} is not supported (llama3, linear)")

    def layer_window(self, i: int) -> Optional[int]:
        """The attention window of decoder layer i (None: full causal attention)."""
        if self.sliding_window is None or (self.sliding_layers is not None and i not in self.sliding_layers):
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> Optional[int]:
        """The window when every layer slides (the KV manager then gives back blocks behind it), else None."""
        return self.sliding_window if self.sliding_layers is None else None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer i has a sparse mixture-of-experts block (else a dense MLP)."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def num_params(self, include_embedding: bool = True, experts_read: Optional[float] = None) -> int:
        """Parameters of the model. experts_read: count only this many routed experts per MoE layer
        (e.g. the experts one step activates; None: all of them)."""
        h, i, L = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 2 * h
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        per_layer += (self.q_size + 2 * self.kv_size) if self.attention_bias else 0
        n = L * per_layer + h + (L - self.num_moe_layers) * 3 * h * i
        if self.num_moe_layers:
            e = self.num_experts if experts_read is None else experts_read
            moe = round(e * 3 * h * self.moe_intermediate_size) + self.num_experts * h  # experts + router
            if self.shared_expert_intermediate_size:
                moe += 3 * h * self.shared_expert_intermediate_size + h
            n += self.num_moe_layers * moe
        emb = self.vocab_size * h
        n += emb if not self.tie_word_embeddings else 0  # lm_head
        return n + (emb if include_embedding else 0)

    def shard(self, tp_size: int) -> "ModelConfig":
        """The shapes one of tp_size tensor-parallel ranks holds (Megatron-style): its share of the
        attention heads and KV heads (one KV head each, replicated, when there are fewer KV heads than
        ranks and they divide the ranks), of the MLP's intermediate size, and of each expert's (every
        rank holds every expert, a slice of each). Raises naming the size that does not divide."""
        if tp_size == 1:
            return self
        dense = any(not self.is_moe_layer(i) for i in range(self.num_hidden_layers))
        sizes = {"num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads}
        if dense:
            sizes["intermediate_size"] = self.intermediate_size
        if self.num_experts:
            sizes["moe_intermediate_size"] = self.moe_intermediate_size
            if self.shared_expert_intermediate_size:
                sizes["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
        kv = self.num_key_value_heads
        if kv < tp_size and tp_size % kv == 0:  # each rank holds one KV head, shared by tp_size / kv ranks
            sizes.pop("num_key_value_heads")
        for name, v in sizes.items():
            if v % tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {name} ({v})"
                                 + (" (nor is it a multiple of the KV heads, which could then be replicated)"
                                    if name == "num_key_value_heads" else ""))
        local = {k: v // tp_size for k, v in sizes.items()}
        local.setdefault("num_key_value_heads", 1)
        if not dense:  # unused (every layer is sparse): only the activation estimate reads it
            local["intermediate_size"] = max(1, self.intermediate_size // tp_size)
        return dataclasses.replace(self, **local)

    def experts_per_step(self, num_tokens: int) -> float:
        """Expected distinct routed experts a step of num_tokens tokens reads per MoE layer, if tokens
        pick experts uniformly: E (1 - (1 - k / E)^T)."""
        if not self.num_experts:
            return 0.0
        e, k = self.num_experts, self.num_experts_per_tok
        return e * (1.0 - (1.0 - k / e) ** max(0, num_tokens))

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """From a HF config.json dict (LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config keys)."""
        qc = d.get("quantization_config")
        if qc:  # weights stored as AWQ / GPTQ / FP8 / bitsandbytes ...: loading them as dense ones would fail late
            method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else "unknown"
            raise ValueError(f"model config: quantized checkpoints ({method}) are not supported; load the "
                             "unquantized (bf16/fp16/fp32) weights, or a GGUF file (dequantized on load)")
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        model_type = d.get("model_type", "llama")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        window, window_layers = _sliding_window(d, model_type)
        if rope_theta is None and isinstance(d.get("rope_parameters"), dict):  # transformers >= 5 layout
            rope_theta = d["rope_parameters"].get("rope_theta")
            if d["rope_parameters"].get("rope_type", "default") != "default":
                rope_scaling = d["rope_parameters"]
        moe = model_type in ("mixtral", "qwen2_moe", "qwen3_moe") or arch in MOE_ARCHITECTURES
        num_experts = int((d.get("num_experts") or d.get("num_local_experts") or 0) if moe else 0)
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("qkv_bias", d.get("attention_bias", model_type in ("qwen2", "qwen2_moe")))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            architecture=arch,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
            sliding_layers=window_layers,
            num_experts=num_experts,
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]) if num_experts else 0,
            # Mixtral always renormalizes; the Qwen MoE configs say (HF's default there: False)
            norm_topk_prob=bool(d.get("norm_topk_prob", False)) if model_type in ("qwen2_moe", "qwen3_moe") else True,
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0) if num_experts else 0,
            decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers accepts (used by tests to build the HF reference)."""
        model_type = _MODEL_TYPES[self.architecture]
        d = dict(
            architectures=[self.architecture], model_type=model_type, vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            tie_word_embeddings=self.tie_word_embeddings, hidden_act="silu",
            bos_token_id=self.bos_token_id, eos_token_id=list(self.eos_token_ids) or None,
        )
        if model_type in ("llama", "qwen3", "qwen3_moe"):
            d["attention_bias"] = self.attention_bias
        if model_type == "qwen2_moe":
            d["qkv_bias"] = self.attention_bias
        if self.num_experts:
            d.update(num_experts_per_tok=self.num_experts_per_tok, decoder_sparse_step=self.decoder_sparse_step,
                     mlp_only_layers=list(self.mlp_only_layers))
            d["num_local_experts" if model_type == "mixtral" else "num_experts"] = self.num_experts
            if model_type != "mixtral":
                d.update(moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                         shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        if self.sliding_window is not None:
            d["sliding_window"] = self.sliding_window
            if model_type in ("mistral", "mixtral"):
                if self.sliding_layers is not None and len(self.sliding_layers) != self.num_hidden_layers:
                    raise ValueError(f"{model_type} slides every layer or none (transformers' config has no "
                                     f"per-layer types for it)")
            else:
                d["use_sliding_window"] = True
                layers = range(self.num_hidden_layers) if self.sliding_layers is None else self.sliding_layers
                if model_type == "qwen3_moe" and len(layers) != self.num_hidden_layers:
                    raise ValueError("qwen3_moe slides every layer or none (transformers reads no layer_types)")
                d["layer_types"] = ["sliding_attention" if i in layers else "full_attention"
                                    for i in range(self.num_hidden_layers)]
        return d


def _sliding_window(d: dict[str, Any], model_type: str) -> tuple[Optional[int], Optional[tuple[int, ...]]]:
    """(window, the layers that slide -- None: all) as transformers 5 reads the config: Mistral /
    Mixtral slide every layer whenever sliding_window is set (Mistral's default: 4096), Qwen3-MoE
    every layer with use_sliding_window; Qwen2/3 with use_sliding_window the layers from
    max_window_layers (default 28) on, Qwen2-MoE the even layers below it -- unless ``layer_types``
    names each layer's kind (Qwen2/3, Qwen2-MoE). Llama never slides. (None, None) when no layer does."""
    # transformers' defaults when the key is absent: MistralConfig and the Qwen configs 4096, Mixtral none;
    # Mistral's and Mixtral's modeling read no use_sliding_window (an explicit false still slides)
    if model_type not in ("mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        return None, None  # (transformers' Llama ignores sliding_window)
    w = d.get("sliding_window", None if model_type == "mixtral" else 4096)
    if not w or (model_type not in ("mistral", "mixtral") and not d.get("use_sliding_window", False)):
        return None, None
    n = int(d["num_hidden_layers"])
    first = int(d.get("max_window_layers") if d.get("max_window_layers") is not None else 28)
    types = d.get("layer_types")
    per_layer = model_type in ("qwen2", "qwen3", "qwen2_moe")  # the others' modeling ignores layer_types
    if per_layer and isinstance(types, list) and len(types) == n:
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif model_type in ("qwen2", "qwen3"):
        layers = tuple(range(first, n))
    elif model_type == "qwen2_moe":
        layers = tuple(i for i in range(n) if i % 2 == 0 and i < first)
    else:
        layers = tuple(range(n))
    if not layers:
        return None, None
    return int(w), (None if len(layers) == n else layers)


def rope_inv_freq(cfg: ModelConfig) -> "Any":
    """Inverse frequencies [head_dim // 2] with Llama 3.1 / linear scaling applied (float32 math, as transformers does, so that greedy outputs match it)."""
    import torch

    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    kind = (rs or {}).get("rope_type", (rs or {}).get("type"))
    if kind == "linear":
        inv = inv / float(rs["factor"])
    elif kind == "llama3":
        factor = float(rs["factor"])
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old_len = float(rs.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(is_mid, mid, scaled)
    return inv
