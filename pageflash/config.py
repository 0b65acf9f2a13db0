"""Model configuration: a frozen dataclass built from a HF config.json dict or GGUF metadata."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

# architecture -> HF model_type
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral", "Qwen2MoeForCausalLM": "qwen2_moe",
                "Qwen3MoeForCausalLM": "qwen3_moe", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
                "Gemma3ForCausalLM": "gemma3_text", "Phi3ForCausalLM": "phi3", "GraniteForCausalLM": "granite",
                "SmolLM3ForCausalLM": "smollm3", "Olmo2ForCausalLM": "olmo2"}
SUPPORTED_ARCHITECTURES = tuple(_MODEL_TYPES)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3_text")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate activation (SwiGLU / GeGLU with tanh GELU)
# rope_scaling types, computed as transformers 5's modeling_rope_utils computes them (layers/rotary.py)
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")

# transformers 5's defaults for keys a config.json may leave out, where they differ from this reader's
# Llama-style fallbacks (GemmaConfig, Gemma2Config, Gemma3TextConfig -- Gemma 3's image-text checkpoints
# keep only a few text_config keys --, GraniteConfig, Phi3Config)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": dict(vocab_size=256000, hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=16, head_dim=256, max_position_embeddings=8192,
                  rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True),
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
                   rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
                   query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131072,
                        rms_norm_eps=1e-6, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
                        query_pre_attn_scalar=256,
                        sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None),
    "granite": dict(rms_norm_eps=1e-6, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2),
    # (SmolLM3Config: its rope_theta default, 2e6, is filled in by from_hf_dict)
    "smollm3": dict(vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768,
                    rms_norm_eps=1e-6, bos_token_id=128000, eos_token_id=128001, tie_word_embeddings=True),
    # Olmo2Config (no bos token; rope_theta 10000 as this reader's fallback)
    "olmo2": dict(vocab_size=50304, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-5, eos_token_id=50279,
                  tie_word_embeddings=False),
    "phi3": dict(vocab_size=32064, rms_norm_eps=1e-5, max_position_embeddings=4096, bos_token_id=1,
                 eos_token_id=32000, original_max_position_embeddings=4096),
}


@dataclass(frozen=True)
class ModelConfig:
    """The shapes and constants of a Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, SmolLM2,
    Phi-3, Gemma 1/2/3, Granite, SmolLM3, OLMo 2), and of its mixture-of-experts variants (Mixtral, Qwen2-MoE, Qwen3-MoE:
    num_experts > 0)."""

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
    # rope_scaling: a dict with "rope_type" (ROPE_TYPES) and its parameters, as transformers 5's
    # rope_parameters hold them (from_hf_dict fills in original_max_position_embeddings)
    rope_scaling: Optional[dict[str, Any]] = field(default=None, hash=False)
    # Phi-3 (Phi-4-mini): only the first rotary_dim = int(head_dim * factor) dims of each head rotate
    partial_rotary_factor: float = 1.0
    # llama.cpp's rope_freqs (GGUF files of Llama 3.1+): inverse frequency i is divided by factor i --
    # the converter's form of the llama3 rope_scaling, whose parameters the file does not keep
    rope_freq_factors: Optional[tuple[float, ...]] = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rope
    # OLMo 2 (with qk_norm): q_norm / k_norm over the whole q and k projections (num_heads * head_dim
    # and num_kv_heads * head_dim weights), not per head
    qk_norm_full: bool = False
    architecture: str = "LlamaForCausalLM"
    bos_token_id: Optional[int] = None
    eos_token_ids: tuple[int, ...] = ()
    # sliding-window attention: a query at position p sees the keys at positions p - sliding_window + 1
    # .. p (transformers' mask); in the layers sliding_layers lists (None: every layer)
    sliding_window: Optional[int] = None
    sliding_layers: Optional[tuple[int, ...]] = None
    # SmolLM3 (NoPE): the layers that apply no rotary embedding at all (its no_rope_layers[i] == 0)
    nope_layers: tuple[int, ...] = ()
    # weights stored as float8 e4m3 codes with scales (model/fp8_checkpoint.py): "fp8", or None
    checkpoint_quantization: Optional[str] = None
    # mixture of experts (0 experts: every layer has a dense MLP of intermediate_size)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = True  # renormalize the top-k routing probabilities to sum to 1 (Mixtral, Qwen3-MoE)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a dense expert every token takes, sigmoid-gated
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()
    # Gemma 1/2/3 (all False / None for the others)
    hidden_act: str = "silu"  # the MLP's gate activation: act(gate) * up
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in float32, rounded once
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the model's dtype
    sandwich_norm: bool = False  # Gemma 2/3: norms after attention and after the MLP too (4 per layer)
    # OLMo 2: no norm before attention or the MLP; each block's output is normed (post_attention_layernorm,
    # post_feedforward_layernorm) before the residual add
    post_norm: bool = False
    # OLMo 2: every RMSNorm multiplies its weight in float32 and rounds once (Olmo2RMSNorm), not
    # weight * (normed x rounded to x's dtype) as LlamaRMSNorm
    norm_float_weight: bool = False
    query_pre_attn_scalar: Optional[float] = None  # the attention scale is its -1/2 power (else head_dim's)
    rope_local_theta: Optional[float] = None  # Gemma 3: the sliding layers' rope base (without rope_scaling)
    attn_logit_softcapping: Optional[float] = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcapping: Optional[float] = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    # Granite (None for the others): embeddings times embedding_multiplier; each block's output times
    # residual_multiplier before the residual add; attention_multiplier is the softmax scale; logits
    # divided by logits_scaling
    embedding_multiplier: Optional[float] = None
    residual_multiplier: Optional[float] = None
    attention_multiplier: Optional[float] = None
    logits_scaling: Optional[float] = None

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
        if any(not isinstance(i, int) or not 0 <= i < self.num_hidden_layers for i in self.nope_layers):
            raise ValueError(f"model config: nope_layers must be layer indices in [0, {self.num_hidden_layers}), "
                             f"got {self.nope_layers!r}")
        if self.qk_norm_full and not self.qk_norm:
            raise ValueError("model config: qk_norm_full (q/k norms over whole projections) needs qk_norm")
        if self.post_norm and self.sandwich_norm:
            raise ValueError("model config: post_norm (OLMo 2) and sandwich_norm (Gemma 2/3) exclude each other")
        if self.norm_float_weight and self.norm_unit_offset:
            raise ValueError("model config: norm_float_weight and norm_unit_offset exclude each other")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"model config: hidden activation {self.hidden_act!r} is not supported "
                             f"({', '.join(ACTIVATIONS)})")
        for name in ("query_pre_attn_scalar", "rope_local_theta", "attn_logit_softcapping", "final_logit_softcapping",
                     "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                raise ValueError(f"model config: {name} must be a positive number or None, got {v!r}")
        self._check_rope()
        if self.rope_freq_factors is not None and (
                len(self.rope_freq_factors) != self.rotary_dim // 2 or not all(f > 0 for f in self.rope_freq_factors)):
            raise ValueError(f"model config: rope_freq_factors must be rotary_dim // 2 = {self.rotary_dim // 2} "
                             f"positive numbers, got {len(self.rope_freq_factors)}")
        if self.rope_freq_factors is not None and self.rope_type in ("yarn", "longrope"):
            # (rope_inv_freq computes these types' frequencies from their own parameters alone)
            raise ValueError(f"model config: rope_freq_factors with rope_scaling type {self.rope_type!r} are not "
                             "supported")

    def _check_rope(self) -> None:
        """partial_rotary_factor and rope_scaling: the type and the fields its computation reads."""
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
            raise ValueError(f"model config: rope_theta must be a positive number, got {theta!r}")
        prf = self.partial_rotary_factor
        if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
            raise ValueError(f"model config: partial_rotary_factor must be a number in (0, 1], got {prf!r}")
        rot = self.rotary_dim
        if rot < 2 or rot % 2:
            raise ValueError(f"model config: the rotary dimension int(head_dim x partial_rotary_factor) = "
                             f"int({self.head_dim} x {prf}) = {rot} must be even and >= 2")
        if rot < self.head_dim and self.architecture != "Phi3ForCausalLM":
            # (transformers' other decoders here rotate whole heads whatever the config says)
            raise ValueError(f"model config: partial rotary embeddings (partial_rotary_factor={prf}) are "
                             f"supported for Phi3ForCausalLM only, not {self.architecture}")
        rs = self.rope_scaling
        if rs is None:
            return
        if not isinstance(rs, dict):
            raise ValueError(f"model config: rope_scaling must be a dict or None, got {type(rs).__name__}")
        kind = self.rope_type
        if kind not in ROPE_TYPES:
            raise ValueError(f"model config: rope_scaling type {kind!r} is not supported "
                             f"({', '.join(ROPE_TYPES[1:])})")

        def number(name: str, minimum: float, required: bool = False) -> None:
            v = rs.get(name)
            if v is None and not required:
                return
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not minimum <= v < math.inf:
                raise ValueError(f"model config: rope_scaling {name} of {kind} must be a number >= {minimum} and "
                                 f"finite, got {v!r}")

        number("factor", 1.0, required=kind in ("linear", "llama3", "dynamic"))
        number("original_max_position_embeddings", 1, required=False)
        if kind == "yarn":
            for name in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
                number(name, 0.0)
        if kind == "longrope":
            if self.architecture != "Phi3ForCausalLM":
                # (the rule of rope_long_after is Phi-3's generation's: transformers' others keep the
                # cache's rotations when a sequence crosses)
                raise ValueError(f"model config: rope_scaling type 'longrope' is supported for Phi3ForCausalLM "
                                 f"only, not {self.architecture}")
            number("attention_factor", 0.0)
            for name in ("short_factor", "long_factor"):
                v = rs.get(name)
                if not (isinstance(v, (list, tuple)) and len(v) == rot // 2 and all(
                        not isinstance(x, bool) and isinstance(x, (int, float)) and 0 < x < math.inf for x in v)):
                    got = f"{len(v)} items" if isinstance(v, (list, tuple)) else repr(v)
                    raise ValueError(f"model config: rope_scaling {name} of longrope must be a list of "
                                     f"{rot // 2} positive finite numbers (rotary dim / 2), got {got}")

    @property
    def rope_type(self) -> str:
        """The rope_scaling type ("default" without one)."""
        rs = self.rope_scaling or {}
        return rs.get("rope_type", rs.get("type")) or "default"

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rotate (head_dim unless partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_original_max(self) -> int:
        """original_max_position_embeddings of llama3 / yarn / longrope scaling: the pretraining context
        (transformers 5's default: max_position_embeddings)."""
        v = (self.rope_scaling or {}).get("original_max_position_embeddings")
        return int(v) if v else self.max_position_embeddings

    @property
    def rope_long_after(self) -> Optional[int]:
        """LongRoPE: the sequence length past which a sequence's KV is computed with the long factors
        (original_max_position_embeddings); None for the other rope types. transformers' Phi-3 takes
        the long factors for a forward whose sequence is longer than that, and its generation drops
        the cache when a sequence grows past it, recomputing the whole sequence with them; so a
        sequence generated alone has its whole KV rotated with the short factors while it is at
        most that long, and with the long ones from then on. The engine does the same per request
        (the scheduler recomputes a request that crosses; vLLM instead switches whole batches, when
        any of its sequences is longer, without recomputing), so that a request's output does not
        depend on its batch."""
        return self.rope_original_max if self.rope_type == "longrope" else None

    def rope_long(self, num_tokens: int) -> bool:
        """Whether a sequence of num_tokens tokens rotates with LongRoPE's long factors (rope_long_after)."""
        after = self.rope_long_after
        return after is not None and num_tokens > after

    @property
    def max_context_len(self) -> int:
        """The longest sequence the model runs: max_position_embeddings, or with YaRN
        original_max_position_embeddings x factor where that is longer (vLLM's rule; Qwen's model cards
        add rope_scaling without raising max_position_embeddings)."""
        rs = self.rope_scaling or {}
        if self.rope_type == "yarn" and rs.get("factor") is not None:
            return max(self.max_position_embeddings, int(self.rope_original_max * float(rs["factor"])))
        return self.max_position_embeddings

    def layer_window(self, i: int) -> Optional[int]:
        """The attention window of decoder layer i (None: full causal attention)."""
        if self.sliding_window is None or (self.sliding_layers is not None and i not in self.sliding_layers):
            return None
        return self.sliding_window

    def layer_rope(self, i: int) -> bool:
        """Whether decoder layer i rotates q and k at all (False: SmolLM3's NoPE layers)."""
        return i not in self.nope_layers

    def layer_rope_local(self, i: int) -> bool:
        """Whether decoder layer i rotates with the local rope base (Gemma 3's sliding layers)."""
        return self.rope_local_theta is not None and self.layer_window(i) is not None

    @property
    def attn_scale(self) -> float:
        """The softmax scale of q . k."""
        if self.attention_multiplier is not None:
            return float(self.attention_multiplier)
        return float(self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

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
        per_layer += (self.q_size + self.kv_size if self.qk_norm_full else 2 * self.head_dim) if self.qk_norm else 0
        per_layer -= h if self.post_norm else 0  # (no input norm)
        per_layer += 2 * h if self.sandwich_norm else 0
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
        # (OLMo 2's q / k norms over the whole projections: each rank holds its heads' slice of the
        # norm weights, and the variance is over the whole projection: an all-reduce of the sums of
        # squares, model/llama.py _full_qk_norms)
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
        """From a HF config.json dict (LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config / the MoE,
        Gemma and Phi-3 configs' keys, read as transformers 5 reads them)."""
        qc = d.get("quantization_config")
        # FP8 checkpoints are read (model/fp8_checkpoint.py); AWQ / GPTQ / bitsandbytes ... are refused
        # here, since loading them as dense weights would fail late
        from pageflash.model.fp8_checkpoint import checkpoint_quantization

        ckpt_quant = checkpoint_quantization(qc) if qc else None
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        model_type = d.get("model_type", "llama")
        if model_type == "gemma3" or arch == "Gemma3ForConditionalGeneration":
            # Gemma 3's image-text checkpoints (4B and up): the text decoder alone (images are not supported)
            text = d.get("text_config") or {}
            if not isinstance(text, dict):
                raise ValueError("model config: Gemma 3's text_config must be a JSON object")
            # the top level's tie / EOS / BOS are what transformers uses (its saved text_config carries
            # its own defaults for them); Gemma3Config ties by default
            top = {k: d[k] for k in ("eos_token_id", "bos_token_id") if k in d}
            top["tie_word_embeddings"] = d.get("tie_word_embeddings", True)
            d = {**text, **top, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
            arch, model_type = "Gemma3ForCausalLM", "gemma3_text"
        if model_type in GEMMA_MODEL_TYPES and d.get("use_bidirectional_attention"):
            raise ValueError("model config: use_bidirectional_attention (an embedding model) is not supported")
        if model_type in _DEFAULTS:
            d = {**_DEFAULTS[model_type], **d}
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        window, window_layers = _sliding_window(d, model_type)
        local_theta = d.get("rope_local_base_freq") if model_type == "gemma3_text" else None
        rp = d.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):  # per layer type (Gemma 3)
            local = rp.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"model config: the sliding layers' rope_type {local['rope_type']!r} is not "
                                 "supported (default)")
            if model_type == "gemma3_text" and local.get("rope_theta") is not None:
                local_theta = local["rope_theta"]
            rp = rp["full_attention"]
        if rope_theta is None and isinstance(rp, dict):  # transformers >= 5 layout
            rope_theta = rp.get("rope_theta")
        if rope_scaling is None and isinstance(rp, dict):
            rope_scaling = rp
        # (transformers 5 takes the top-level factor where its rope parameters have none)
        prf = next((x["partial_rotary_factor"] for x in (rope_scaling, rp)
                    if isinstance(x, dict) and x.get("partial_rotary_factor") is not None),
                   d.get("partial_rotary_factor"))
        rope_scaling = _rope_scaling(rope_scaling, d, model_type)
        gemma = model_type in GEMMA_MODEL_TYPES
        gemma23 = model_type in ("gemma2", "gemma3_text")  # (sandwich norms, hidden_activation, scalars)
        if model_type == "smollm3":
            _check_smollm3(d)
            rope_theta = 2_000_000.0 if rope_theta is None else rope_theta  # (SmolLM3Config.default_theta)
        if model_type == "olmo2":
            _check_olmo2(d)
        if model_type == "gemma3_text":  # its defaults: 1e6 for the full layers, 1e4 for the sliding ones
            rope_theta = 1_000_000.0 if rope_theta is None else rope_theta
            local_theta = 10_000.0 if local_theta is None else local_theta
        act = d.get("hidden_activation") if gemma23 else d.get("hidden_act")
        act = {"swish": "silu", "gelu_tanh": "gelu_pytorch_tanh"}.get(act, act) or (
            "gelu_pytorch_tanh" if gemma else "silu")
        if model_type == "gemma" and act == "gelu":  # as transformers: Gemma's "gelu" means the tanh form
            act = "gelu_pytorch_tanh"
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
            # (a number as float; anything else as given, for __post_init__ to name)
            rope_theta=float(rope_theta) if isinstance(rope_theta, (int, float)) and not isinstance(rope_theta, bool)
            else 10000.0 if rope_theta is None else rope_theta,
            rope_scaling=rope_scaling,
            partial_rotary_factor=1.0 if prf is None else prf,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("qkv_bias", d.get("attention_bias", model_type in ("qwen2", "qwen2_moe")))),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM"),
            qk_norm_full=model_type == "olmo2",
            post_norm=model_type == "olmo2",
            norm_float_weight=model_type == "olmo2",
            architecture=arch,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=window,
            sliding_layers=window_layers,
            nope_layers=_nope_layers(d) if model_type == "smollm3" else (),
            checkpoint_quantization=ckpt_quant,
            num_experts=num_experts,
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0) if num_experts else 0,
            moe_intermediate_size=int(d.get("moe_intermediate_size") or d["intermediate_size"]) if num_experts else 0,
            # Mixtral always renormalizes; the Qwen MoE configs say (HF's default there: False)
            norm_topk_prob=bool(d.get("norm_topk_prob", False)) if model_type in ("qwen2_moe", "qwen3_moe") else True,
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size") or 0) if num_experts else 0,
            decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()),
            hidden_act=act,
            norm_unit_offset=gemma,
            embed_scale=gemma,
            sandwich_norm=gemma23,
            query_pre_attn_scalar=_opt_float(d.get("query_pre_attn_scalar")) if gemma23 else None,
            rope_local_theta=_opt_float(local_theta),
            # (transformers' Gemma 3 reads no attn_logit_softcapping, only Gemma 2 caps its scores)
            attn_logit_softcapping=_opt_float(d.get("attn_logit_softcapping")) if model_type == "gemma2" else None,
            final_logit_softcapping=_opt_float(d.get("final_logit_softcapping")) if gemma23 else None,
            **(_granite_fields(d) if model_type == "granite" else {}),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers accepts (used by tests to build the HF reference)."""
        model_type = _MODEL_TYPES[self.architecture]
        if self.rope_freq_factors is not None:  # (a GGUF's: transformers' config has no such field)
            raise ValueError("a config with rope_freq_factors has no HF config.json form")
        d = dict(
            architectures=[self.architecture], model_type=model_type, vocab_size=self.vocab_size,
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            tie_word_embeddings=self.tie_word_embeddings, hidden_act=self.hidden_act,
            bos_token_id=self.bos_token_id, eos_token_id=list(self.eos_token_ids) or None,
        )
        if model_type == "granite":
            d.update(attention_bias=self.attention_bias, embedding_multiplier=self.embedding_multiplier,
                     residual_multiplier=self.residual_multiplier, attention_multiplier=self.attention_multiplier,
                     logits_scaling=self.logits_scaling)
        if model_type in GEMMA_MODEL_TYPES:
            d["attention_bias"] = self.attention_bias
            if model_type != "gemma":
                d.update(hidden_activation=self.hidden_act, query_pre_attn_scalar=self.query_pre_attn_scalar,
                         attn_logit_softcapping=self.attn_logit_softcapping,
                         final_logit_softcapping=self.final_logit_softcapping, sliding_window=self.sliding_window)
                if self.sliding_window is None:  # transformers' default would slide with 4096
                    raise ValueError(f"{model_type}: the config needs a sliding window")
            if model_type == "gemma3_text":
                d["rope_local_base_freq"] = self.rope_local_theta
        if model_type in ("llama", "qwen3", "qwen3_moe"):
            d["attention_bias"] = self.attention_bias
        if self.nope_layers and model_type != "smollm3":
            raise ValueError(f"{model_type}: transformers' config has no NoPE layers (SmolLM3's no_rope_layers)")
        if model_type == "smollm3":
            d.update(attention_bias=self.attention_bias, mlp_bias=False,
                     no_rope_layers=[int(self.layer_rope(i)) for i in range(self.num_hidden_layers)])
        olmo = (self.qk_norm_full, self.post_norm, self.norm_float_weight)
        if model_type == "olmo2":
            if olmo != (True, True, True) or not self.qk_norm:
                raise ValueError("olmo2: transformers' OLMo 2 has whole-projection q/k norms and post norms")
            d["attention_bias"] = self.attention_bias
        elif any(olmo):
            raise ValueError(f"{model_type}: transformers' config has no OLMo 2 norms (qk_norm_full, post_norm, "
                             f"norm_float_weight)")
        if model_type == "phi3":  # (Phi3Config reads the pretraining context from the top level only)
            d.update(partial_rotary_factor=self.partial_rotary_factor,
                     original_max_position_embeddings=self.rope_original_max)
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
            if model_type == "gemma":
                raise ValueError("gemma has no sliding window")
            if model_type in ("mistral", "mixtral", "phi3"):
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
    if model_type in ("gemma2", "gemma3_text"):
        # the even layers of Gemma 2 slide, 5 of every 6 of Gemma 3 (sliding_window_pattern), unless
        # layer_types says; the defaults (4096) are filled in by from_hf_dict
        n = int(d["num_hidden_layers"])
        types = d.get("layer_types")
        if isinstance(types, list) and len(types) == n:
            layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        else:
            pattern = 2 if model_type == "gemma2" else int(d.get("sliding_window_pattern") or 6)
            layers = tuple(i for i in range(n) if (i + 1) % pattern)
        w = d.get("sliding_window")
        if not w or not layers:
            return None, None
        return int(w), (None if len(layers) == n else layers)
    if model_type == "smollm3":
        # the layers layer_types calls sliding_attention (the mask transformers' SDPA / eager attention
        # takes; its flash path also wants use_sliding_window); without layer_types, SmolLM3Config
        # makes the NoPE layers slide when use_sliding_window and sliding_window are set
        n = int(d["num_hidden_layers"])
        w = d.get("sliding_window")
        types = d.get("layer_types")
        if isinstance(types, list) and len(types) >= n:
            layers = tuple(i for i in range(n) if types[i] == "sliding_attention")
        elif d.get("use_sliding_window") and w:
            layers = _nope_layers(d)
        else:
            layers = ()
        if not w or not layers:
            return None, None
        return int(w), (None if len(layers) == n else layers)
    if model_type == "phi3":  # every layer slides when sliding_window is set (transformers' default: none)
        # (Phi-3.5 / Phi-4-mini set 262144, beyond their context: a window that never bites is none)
        w = d.get("sliding_window")
        return (int(w), None) if w and int(w) < int(d["max_position_embeddings"]) else (None, None)
    if model_type not in ("mistral", "mixtral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        return None, None  # (transformers' Llama and Gemma 1 ignore sliding_window)
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


def _rope_scaling(rs: Any, d: dict[str, Any], model_type: str) -> Optional[dict[str, Any]]:
    """A config's rope_scaling (or transformers 5's rope_parameters) as transformers 5 standardizes it:
    a copy with "rope_type" set (None for the default rope) and, for llama3 / yarn / longrope, the
    pretraining context original_max_position_embeddings -- Phi-3's from its top-level key (default
    4096), which wins over the dict's; others' from the dict, else max_position_embeddings. Phi-3 reads
    the old types "su" and "yarn" as longrope."""
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"model config: rope_scaling must be a JSON object or null, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type")) or "default"
    if model_type == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"
    if kind == "default":
        return None
    rs = {**rs, "rope_type": kind}
    if kind in ("llama3", "yarn", "longrope"):
        if model_type == "phi3":
            rs["original_max_position_embeddings"] = d["original_max_position_embeddings"]
        else:
            rs.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 4096))
    return rs


def _nope_layers(d: dict[str, Any]) -> tuple[int, ...]:
    """SmolLM3's layers without rotary embeddings: those whose no_rope_layers entry is 0 (the list may
    be longer than the model); without the list, every no_rope_layer_interval-th layer (default 4:
    layers 3, 7, ...), as SmolLM3Config builds it."""
    n = int(d["num_hidden_layers"])
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d.get("no_rope_layer_interval") or 4)
        return tuple(i for i in range(n) if (i + 1) % interval == 0)
    if not isinstance(flags, (list, tuple)) or len(flags) < n or any(
            isinstance(f, bool) or f not in (0, 1) for f in flags[:n]):
        raise ValueError(f"model config: no_rope_layers must be a list of at least num_hidden_layers ({n}) "
                         f"0 / 1 flags, got {flags!r}")
    return tuple(i for i in range(n) if not flags[i])


def _check_smollm3(d: dict[str, Any]) -> None:
    """What SmolLM3Config allows that this decoder does not run: biases on o_proj (attention_bias puts
    one on q, k, v and o) and on the MLP's projections."""
    if d.get("attention_bias"):
        raise ValueError("model config: SmolLM3's attention_bias (biases on q/k/v and o_proj) is not supported")
    if d.get("mlp_bias"):
        raise ValueError("model config: mlp_bias (biases on the MLP's projections) is not supported")


def _check_olmo2(d: dict[str, Any]) -> None:
    """What Olmo2Config allows that this decoder does not run: attention_bias (biases on q/k/v and
    o_proj)."""
    if d.get("attention_bias"):
        raise ValueError("model config: OLMo 2's attention_bias (biases on q/k/v and o_proj) is not supported")


def _granite_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Granite's multipliers (transformers' GraniteConfig defaults: 1.0 each)."""
    if d.get("mlp_bias"):
        raise ValueError("model config: mlp_bias (biases on the MLP's projections) is not supported")
    return {name: float(d.get(name, 1.0)) for name in ("embedding_multiplier", "residual_multiplier",
                                                        "attention_multiplier", "logits_scaling")}


def _opt_float(v: Any) -> Optional[float]:
    return None if v is None else float(v)
