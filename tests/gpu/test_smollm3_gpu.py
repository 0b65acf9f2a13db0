"""SmolLM3 on the GPU: the engine (Triton backend with its fused rope-in-decode kernel, CUDA graphs,
async scheduling, n-gram verify graphs) against the reference backend in float32, dummy weights at
SmolLM3-3B's layer shapes (hidden 2048, 16 / 4 heads of 128), every 4th layer without rotary
embeddings (NoPE), with and without those layers sliding over a window."""

from __future__ import annotations

import json

import pytest

from test_window_gpu import _run

SMOLLM3 = dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", vocab_size=128256, hidden_size=2048,
               intermediate_size=11008, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
               max_position_embeddings=4096, rope_theta=5_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
               no_rope_layers=[1, 1, 1, 0], bos_token_id=128000, eos_token_id=128001)


@pytest.mark.parametrize("over", [{}, dict(use_sliding_window=True, sliding_window=64)], ids=["full", "nope-slides"])
def test_smollm3_engine_triton_graphs_equal_torch_fp32(tmp_path, over):
    (tmp_path / "config.json").write_text(json.dumps(dict(SMOLLM3, **over)))
    folder = str(tmp_path)
    ref, llm = _run(folder, attention_backend="torch", enforce_eager=True)
    assert llm.llm_engine.model_config.nope_layers == (3,)
    tri, llm = _run(folder)  # Triton, decode graphs, async scheduling
    assert llm.llm_engine.runner.graphs is not None
    assert tri == ref
    tree, _ = _run(folder, speculative_config=dict(method="ngram", tree=[2], num_speculative_tokens=6))
    assert tree == ref
