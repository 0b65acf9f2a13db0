"""Checkpoints whose weights are already FP8 (model/fp8_checkpoint.py): written here from a random HF
model in the layouts of transformers' / vLLM's Fp8Config (per-tensor `weight_scale`, block
`weight_scale_inv`) and of llm-compressor's compressed-tensors (per-channel `weight_scale`, an
`ignore` list), then run by the engine as quantization="fp8" against HF transformers over the
checkpoint's dequantized weights."""

import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_ref import hf_greedy, make_random_hf_folder
from pageflash import LLM, SamplingParams
from pageflash.model.fp8_checkpoint import dequantize

FP8 = torch.float8_e4m3fn
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

CFG = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
           rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _quantize(w: torch.Tensor, scheme: str):
    """(codes, scale tensor as the checkpoint stores it) for one weight."""
    if scheme == "tensor":
        s = w.abs().max() / 448
    elif scheme == "channel":
        s = w.abs().amax(1, keepdim=True) / 448
    else:  # 32 x 32 blocks (ragged at the edges: 96 = 3 x 32, 64 = 2 x 32 -- and 80 rows below)
        n, k = w.shape
        pad = torch.zeros(-(-n // 32) * 32, -(-k // 32) * 32)
        pad[:n, :k] = w.abs()
        s = pad.view(pad.shape[0] // 32, 32, pad.shape[1] // 32, 32).amax(dim=(1, 3)) / 448
        full = s.repeat_interleave(32, 0).repeat_interleave(32, 1)[:n, :k]
        return (w / full).clamp(-448, 448).to(FP8), s
    return (w / s).clamp(-448, 448).to(FP8), s.float()


def _per_expert(sd: dict) -> dict:
    """transformers 5's fused expert tensors ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) as the
    per-expert gate_proj / up_proj / down_proj weights FP8 releases store."""
    out = {}
    for name, t in sd.items():
        if name.endswith(".experts.gate_up_proj"):
            base, i = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :i].contiguous()
                out[f"{base}{e}.up_proj.weight"] = t[e, i:].contiguous()
        elif name.endswith(".experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def _load_all(folder: str) -> dict:
    sd = {}
    for f in glob.glob(os.path.join(folder, "*.safetensors")):
        sd.update(load_file(f))
    return sd


def write_fp8_checkpoint(src: str, dst, scheme: str, fmt: str, ignore=()) -> str:
    """A copy of the HF folder src (one safetensors file) whose decoder projections, experts included,
    are e4m3 codes with scales (scheme: "tensor", "channel" or "block"; fmt: "fp8" (Fp8Config names)
    or "compressed-tensors"); projections whose name contains an `ignore` entry stay float32; static
    input scales are written too (the engine does not use them). Returns the folder."""
    os.makedirs(dst, exist_ok=True)
    out = {}
    for name, t in _per_expert(_load_all(src)).items():
        if name.endswith(".weight") and any(f".{p}." in name for p in PROJ) and not any(i in name for i in ignore):
            q, s = _quantize(t, scheme)
            out[name] = q
            base = name[: -len("weight")]
            out[base + ("weight_scale_inv" if scheme == "block" and fmt == "fp8" else "weight_scale")] = s
            out[base + "input_scale"] = torch.tensor(0.05)
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    for f in glob.glob(os.path.join(src, "*.json")):
        if os.path.basename(f) == "model.safetensors.index.json":
            continue
        d = json.load(open(f))
        if os.path.basename(f) == "config.json":
            if fmt == "fp8":
                d["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
                if scheme == "block":
                    d["quantization_config"]["weight_block_size"] = [32, 32]
            else:
                d["quantization_config"] = {
                    "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head", *ignore],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                        "num_bits": 8, "type": "float", "strategy": scheme, "dynamic": False, "symmetric": True},
                        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}}
        json.dump(d, open(os.path.join(dst, os.path.basename(f)), "w"))
    return str(dst)


def hf_dequantized(src: str, fp8_folder: str):
    """HF's model of src with each projection (and expert) replaced by the FP8 checkpoint's dequantized
    weight."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    sd = _load_all(fp8_folder)
    deq = {}
    for name, t in sd.items():
        if t.dtype == FP8:
            base = name[: -len("weight")]
            deq[name] = dequantize(t, sd.get(base + "weight_scale", sd.get(base + "weight_scale_inv")), name)
        else:
            deq[name] = t
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in deq:
                p.copy_(deq[name])
            elif name.endswith(".experts.gate_up_proj"):
                base = name[: -len("gate_up_proj")]
                p.copy_(torch.stack([torch.cat([deq[f"{base}{e}.gate_proj.weight"], deq[f"{base}{e}.up_proj.weight"]])
                                     for e in range(p.shape[0])]))
            elif name.endswith(".experts.down_proj"):
                base = name[: -len("down_proj")]
                p.copy_(torch.stack([deq[f"{base}{e}.down_proj.weight"] for e in range(p.shape[0])]))
            else:
                raise AssertionError(name)
    return hf


PROMPTS = [[5, 9, 17, 33, 2], list(range(40, 71)), [100]]


@pytest.mark.parametrize("scheme,fmt", [("tensor", "fp8"), ("channel", "compressed-tensors")])
def test_fp8_checkpoint_codes_kept_and_greedy_matches_hf(tmp_path, scheme, fmt):
    """One scale per tensor or per row: the engine keeps the checkpoint's codes bit for bit (the scale
    spread over the rows), runs as quantization="fp8", and greedy equals HF over the dequantized
    weights (on CPU every product is the dequantized weight)."""
    src = make_random_hf_folder(tmp_path / "src", CFG, std=0.3)
    folder = write_fp8_checkpoint(src, tmp_path / "fp8", scheme, fmt)
    llm = LLM(folder, max_model_len=96, num_kv_blocks=32)
    runner = llm.llm_engine.runner
    assert runner.quantization == "fp8"
    qkv = runner.model.layers[1].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.weight_scale.shape == (qkv.weight.shape[0],)
    sd = _load_all(folder)
    k = sd["model.layers.1.self_attn.k_proj.weight"]
    off, size = qkv.shard_offsets["k"]
    assert torch.equal(qkv.weight[off: off + size].view(torch.uint8), k.view(torch.uint8))
    ks = sd["model.layers.1.self_attn.k_proj.weight_scale"].float().reshape(-1)
    assert torch.equal(qkv.weight_scale[off: off + size], ks.expand(size))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    hf = hf_dequantized(src, folder)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 16) for p in PROMPTS]


def test_fp8_checkpoint_block_scales_requantized_per_row(tmp_path):
    """Block scales (Fp8Config's weight_scale_inv, 32 x 32 blocks, ragged edges) are dequantized and
    quantized again per row: each weight within half an e4m3 step (2**-4 relative, 2**-10 of the
    row's scale absolute) of the checkpoint's value; the model runs."""
    cfg = dict(CFG, intermediate_size=80)  # rows of gate/up and columns of down not a multiple of 32
    src = make_random_hf_folder(tmp_path / "src", cfg, std=0.3)
    folder = write_fp8_checkpoint(src, tmp_path / "fp8", "block", "fp8")
    llm = LLM(folder, max_model_len=96, num_kv_blocks=32)
    hf = hf_dequantized(src, folder)
    down = llm.llm_engine.runner.model.layers[0].mlp.down_proj
    assert down.weight.dtype == FP8
    want = hf.model.layers[0].mlp.down_proj.weight
    got = down.weight.float() * down.weight_scale[:, None]
    y = want / down.weight_scale[:, None]
    bound = torch.maximum(y.abs() * 2 ** -4, torch.full_like(y, 2 ** -10)) * down.weight_scale[:, None]
    assert ((got - want).abs() <= bound * (1 + 1e-5)).all()
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16


def test_fp8_checkpoint_ignored_layers_stay_16_bit(tmp_path):
    src = make_random_hf_folder(tmp_path / "src", CFG, std=0.3)
    folder = write_fp8_checkpoint(src, tmp_path / "fp8", "channel", "compressed-tensors", ignore=("layers.0.mlp",))
    llm = LLM(folder, max_model_len=96, num_kv_blocks=32)
    layer0, layer1 = llm.llm_engine.runner.model.layers
    assert layer0.mlp.down_proj.weight.dtype == torch.float32 and layer0.mlp.down_proj.weight_scale is None
    assert layer0.self_attn.o_proj.weight.dtype == FP8 and layer1.mlp.down_proj.weight.dtype == FP8
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    hf = hf_dequantized(src, folder)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 16) for p in PROMPTS]


def test_fp8_checkpoint_bad_inputs(tmp_path):
    src = make_random_hf_folder(tmp_path / "src", CFG, std=0.3)
    folder = write_fp8_checkpoint(src, tmp_path / "fp8", "channel", "compressed-tensors")
    with pytest.raises(ValueError, match=r"weights are FP8.*quantization must be None or 'fp8', got 'int8'"):
        LLM(folder, quantization="int8", max_model_len=96, num_kv_blocks=32)
    # a scale missing: the weight is named
    path = os.path.join(folder, "model.safetensors")
    sd = load_file(path)
    del sd["model.layers.0.mlp.up_proj.weight_scale"]
    save_file(sd, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"float8 weights without a weight_scale: \['model.layers.0.mlp.up_proj.weight'\]"):
        LLM(folder, max_model_len=96, num_kv_blocks=32)
    # other quantized formats are still refused by name
    cfg = json.load(open(os.path.join(src, "config.json")))
    for qc, name in (({"quant_method": "awq", "bits": 4}, "awq"),
                     ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
                         "g": {"weights": {"num_bits": 4, "type": "int"}}}}, "compressed-tensors")):
        cfg["quantization_config"] = qc
        json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
        with pytest.raises(ValueError, match=rf"quantized checkpoints \({name}"):
            LLM(src, max_model_len=96, num_kv_blocks=32)


@pytest.mark.parametrize("name", ["qwen2-moe", "qwen3-moe"])
def test_fp8_checkpoint_moe_experts_requantized(tmp_path, name):
    """A mixture of experts: dense projections (Qwen2-MoE's shared expert, attention) keep their codes;
    the experts arrive dequantized and are quantized again per row (with per-channel checkpoint scales
    that gives the checkpoint's values back: each row's largest code is +-448); the router stays exact.
    Greedy equals HF over the checkpoint's dequantized weights."""
    from test_engine_hf import CONFIGS

    from pageflash.layers.moe import SparseMoE

    src = make_random_hf_folder(tmp_path / "src", CONFIGS[name], std=0.3)
    folder = write_fp8_checkpoint(src, tmp_path / "fp8", "channel", "compressed-tensors")
    llm = LLM(folder, max_model_len=64, num_kv_blocks=64)
    moe = llm.llm_engine.runner.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and moe.w13.dtype == FP8 and moe.w2_scale is not None
    assert moe.gate.weight.dtype == torch.float32
    hf = hf_dequantized(src, folder)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                        use_tqdm=False)]
    assert got == [hf_greedy(hf, p, 16) for p in PROMPTS]


@pytest.mark.parametrize("name,scheme", [("llama-gqa", "channel"), ("llama-mqa-tied", "tensor")])
def test_fp8_checkpoint_on_two_ranks_matches_hf(tmp_path, name, scheme):
    """Tensor parallelism over an FP8 checkpoint: column-parallel ranks take their rows of the codes and
    of the per-row scales (MQA: the replicated KV head's), row-parallel ones their columns and every
    row's scale; greedy equals HF over the checkpoint's dequantized weights (two processes, gloo)."""
    from test_engine_hf import CONFIGS

    src = make_random_hf_folder(tmp_path / "src", CONFIGS[name], std=0.3)
    folder = write_fp8_checkpoint(src, tmp_path / "fp8", scheme, "compressed-tensors" if scheme == "channel" else "fp8")
    llm = LLM(folder, max_model_len=64, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                            use_tqdm=False)]
    finally:
        llm.shutdown()
    hf = hf_dequantized(src, folder)
    assert got == [hf_greedy(hf, p, 16) for p in PROMPTS]
