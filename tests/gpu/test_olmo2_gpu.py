"""OLMo 2 on the GPU: the engine (Triton backend, CUDA graphs with the unfused float32-weight norms and
the whole-projection q/k norms, async scheduling, n-gram verify graphs) against the reference backend
in float32, dummy weights at OLMo-2-1B-like layer shapes (hidden 2048, 16 heads of 128)."""

from __future__ import annotations

import json

from test_window_gpu import _run

OLMO2 = dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2", vocab_size=100352, hidden_size=2048,
             intermediate_size=8192, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
             max_position_embeddings=4096, rope_theta=500_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
             eos_token_id=100257, pad_token_id=100277)


def test_olmo2_engine_triton_graphs_equal_torch_fp32(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OLMO2))
    folder = str(tmp_path)
    ref, llm = _run(folder, attention_backend="torch", enforce_eager=True)
    assert llm.llm_engine.model_config.post_norm and llm.llm_engine.model_config.qk_norm_full
    tri, llm = _run(folder)  # Triton, decode graphs, async scheduling
    assert llm.llm_engine.runner.graphs is not None
    assert tri == ref
    tree, _ = _run(folder, speculative_config=dict(method="ngram", tree=[2], num_speculative_tokens=6))
    assert tree == ref
