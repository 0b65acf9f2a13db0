"""Rope variants on the GPU: the engine with the Triton backend (decode graphs, async scheduling, n-gram
verify graphs) against the reference backend in float32, at real head sizes (2 layers, dummy weights),
for each rope type the kernels take: linear, llama3, YaRN (with and without mscale), a Qwen2 YaRN
config, and Phi-3's partial rotary with LongRoPE switching while requests decode."""

from __future__ import annotations

import json

import pytest

from pageflash.model.registry import NAMED_CONFIGS
from test_window_gpu import _run

LLAMA = dict(NAMED_CONFIGS["llama-3-8b"], num_hidden_layers=2, max_position_embeddings=512)
CASES = {
    "linear": dict(LLAMA, rope_scaling=dict(rope_type="linear", factor=2.0)),
    "llama3": dict(LLAMA, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                            original_max_position_embeddings=128)),
    "yarn": dict(LLAMA, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)),
    "yarn-mscale": dict(LLAMA, rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=128,
                                                 mscale=1.0, mscale_all_dim=0.707, beta_fast=24, beta_slow=2)),
    "dynamic": dict(LLAMA, rope_scaling=dict(rope_type="dynamic", factor=2.0)),
    "qwen2-yarn": dict(NAMED_CONFIGS["qwen2.5-7b"], num_hidden_layers=2, max_position_embeddings=512,
                       rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128)),
    # 96 of 128 dims rotate; LongRoPE's long factors from 120 tokens: prompts of 180 and 250 use them
    # throughout, the 100-token one is recomputed when it crosses while decoding
    "phi-4-mini-longrope": dict(NAMED_CONFIGS["phi-4-mini"], num_hidden_layers=2, original_max_position_embeddings=120),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_engine_triton_graphs_equal_torch_fp32(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(CASES[name]))
    ref, _ = _run(str(tmp_path), attention_backend="torch", enforce_eager=True)
    tri, llm = _run(str(tmp_path))
    assert llm.llm_engine.runner.graphs is not None
    assert tri == ref
    spec, _ = _run(str(tmp_path), speculative_config=dict(method="ngram", num_speculative_tokens=4))
    assert spec == ref
