"""Mixture-of-experts layers (CPU): config parsing, routing against transformers' routers, the experts'
reference against a per-token loop, checkpoint layouts, quantization leaving routers and experts alone.
The engine's greedy output against HF for Mixtral / Qwen2-MoE / Qwen3-MoE is in test_engine_hf.py."""

import json
import os

import pytest
import torch

from hf_ref import hf_greedy, make_random_hf_folder
from pageflash import LLM, SamplingParams
from pageflash.config import ModelConfig
from pageflash.layers.moe import SparseMoE, experts_ref, route
from pageflash.model.llama import LlamaForCausalLM, LlamaMLP
from pageflash.model.registry import NAMED_CONFIGS
from test_engine_hf import CONFIGS

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_config_from_hf_dicts():
    q3 = ModelConfig.from_hf_dict(NAMED_CONFIGS["qwen3-30b-a3b"])
    assert (q3.num_experts, q3.num_experts_per_tok, q3.moe_intermediate_size, q3.norm_topk_prob) == (128, 8, 768, True)
    assert q3.qk_norm and q3.num_moe_layers == 48
    # the published sizes: 30.5B parameters, 3.3B active
    assert abs(q3.num_params() / 1e9 - 30.5) < 0.1
    assert abs(q3.num_params(experts_read=8) / 1e9 - 3.3) < 0.1
    assert q3.experts_per_step(1) == pytest.approx(8.0)
    assert 120 < q3.experts_per_step(64) < 128
    q2 = ModelConfig.from_hf_dict(NAMED_CONFIGS["qwen1.5-moe-a2.7b"])
    assert q2.attention_bias and not q2.norm_topk_prob and q2.shared_expert_intermediate_size == 5632
    assert abs(q2.num_params() / 1e9 - 14.3) < 0.1
    mx = ModelConfig.from_hf_dict(CONFIGS["mixtral"])
    assert (mx.num_experts, mx.moe_intermediate_size, mx.norm_topk_prob) == (4, 96, True)
    sparse = ModelConfig.from_hf_dict(dict(CONFIGS["qwen3-moe"], num_hidden_layers=6, decoder_sparse_step=2,
                                           mlp_only_layers=[3]))
    assert [sparse.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    # a dense config ignores stray MoE keys; an MoE architecture without experts is refused
    assert ModelConfig.from_hf_dict(dict(CONFIGS["llama-gqa"], num_experts=8)).num_experts == 0
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf_dict(dict(CONFIGS["mixtral"], num_local_experts=0))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict(dict(CONFIGS["mixtral"], num_experts_per_tok=5))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict(dict(CONFIGS["mixtral"], num_experts_per_tok=0))


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_num_params_counts_the_model(name):
    cfg = ModelConfig.from_hf_dict(CONFIGS[name])
    model = LlamaForCausalLM(cfg, max_positions=64)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_route_matches_transformers(arch):
    from transformers import AutoConfig

    if arch == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router
        cfg = AutoConfig.for_model("mixtral", hidden_size=16, num_local_experts=7, num_experts_per_tok=3)
        renorm = True
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router
        cfg = AutoConfig.for_model("qwen3_moe", hidden_size=16, num_experts=7, num_experts_per_tok=3,
                                   norm_topk_prob=False)
        renorm = False
    router = Router(cfg)
    torch.manual_seed(0)
    router.weight.data.normal_()
    x = torch.randn(23, 16)
    _, want_w, want_ids = router(x)
    w, ids = route(torch.nn.functional.linear(x, router.weight), 3, renorm)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w.float())
    assert w.dtype == torch.float32
    if renorm:
        torch.testing.assert_close(w.sum(-1), torch.ones(23))


def test_experts_ref_equals_a_per_token_loop():
    torch.manual_seed(0)
    t, h, i, e, k = 19, 24, 20, 5, 2
    x = torch.randn(t, h, dtype=torch.float64)
    w13, w2 = torch.randn(e, 2 * i, h, dtype=torch.float64), torch.randn(e, h, i, dtype=torch.float64)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    ids[:7] = torch.tensor([3, 1])  # many tokens on one expert; expert 4 maybe unused by some
    weights = torch.rand(t, k, dtype=torch.float32)
    got = experts_ref(x, w13, w2, weights, ids)
    want = torch.zeros(t, h, dtype=torch.float64)
    for r in range(t):
        for j in range(k):
            g, u = (w13[ids[r, j]] @ x[r]).chunk(2)
            want[r] += float(weights[r, j]) * (w2[ids[r, j]] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)  # the sum is accumulated in float32


def test_sparse_moe_weight_loader_checks_shapes():
    moe = SparseMoE(8, 3, 2, 6, True)
    moe.weight_loader(moe.w13, torch.ones(6, 8), "1:up")
    assert moe.w13[1, 6:].eq(1).all() and not moe.w13[1, :6].eq(1).all()
    with pytest.raises(ValueError, match="expert 0 gate weight shape mismatch"):
        moe.weight_loader(moe.w13, torch.ones(5, 8), "0:gate")
    with pytest.raises(ValueError, match="expert 3"):
        moe.weight_loader(moe.w2, torch.ones(8, 6), "3:down")
    with pytest.raises(ValueError, match="expert weight shape mismatch"):
        moe.weight_loader(moe.w2, torch.ones(3, 6, 8), None)


def _fused_layout_folder(src: str, dst) -> str:
    """The same weights saved under transformers >= 5's in-memory names (experts.gate_up_proj [E, 2I, H],
    experts.down_proj [E, H, I]) as another engine or a newer export might write them."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    state = {n: p.detach().contiguous() for n, p in model.state_dict().items()}
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in state)
    os.makedirs(dst, exist_ok=True)
    save_file(state, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_fused_expert_checkpoint_layout_loads(tmp_path, name):
    from transformers import AutoModelForCausalLM

    folder = make_random_hf_folder(tmp_path / "a", CONFIGS[name])
    fused = _fused_layout_folder(folder, tmp_path / "b")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [[5, 9, 1, 77, 12], list(range(30, 60))]
    llm = LLM(fused, max_model_len=64, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 10)


def test_missing_expert_is_reported(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    folder = make_random_hf_folder(tmp_path, CONFIGS["mixtral"])
    for fn in os.listdir(folder):
        if fn.endswith(".safetensors"):
            path = os.path.join(folder, fn)
            with safe_open(path, "pt") as f:
                state = {k: f.get_tensor(k) for k in f.keys()}
            if any(".experts.2.w3." in k for k in state):
                save_file({k: v for k, v in state.items() if ".layers.1.block_sparse_moe.experts.2.w3." not in k}, path,
                          metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\) the model needs: "
                                         r"\['model.layers.1.block_sparse_moe.experts.2.w3.weight'\]"):
        LLM(folder, max_model_len=64, num_kv_blocks=16)


def _fake_quantized_hf(folder, method="int8"):
    """HF's model with every decoder projection and every expert matrix replaced by dequantize(quantize(w))
    per row, the routers and Qwen2-MoE's shared-expert gate left exact: what the engine's int8 / fp8
    layers compute (weight-only), run by HF's code."""
    from transformers import AutoModelForCausalLM

    from pageflash.kernels.w8_linear import dequantize_int8
    from pageflash.layers.linear import quantize_weight

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.model.layers.named_parameters():
            if p.dim() < 2 or name.endswith("mlp.gate.weight") or "shared_expert_gate" in name:
                continue
            q, sc = quantize_weight(p.reshape(-1, p.shape[-1]), method)
            p.copy_(dequantize_int8(q, sc, torch.float32).view(p.shape))
    return hf


@pytest.mark.parametrize("name,method", [("qwen2-moe", "int8"), ("mixtral", "int8"), ("qwen2-moe", "fp8")])
def test_quantized_experts_match_hf_on_fake_quantized_weights(tmp_path, name, method):
    """quantization="int8" / "fp8" turns the experts into int8 / e4m3 codes with a scale per row (the
    routers and the shared-expert gate stay exact); greedy equals HF over the dequantized codes, and
    differs from the float model's (the quantization is applied)."""
    from transformers import AutoModelForCausalLM

    folder = make_random_hf_folder(tmp_path, CONFIGS[name], std=0.3)
    llm = LLM(folder, max_model_len=64, num_kv_blocks=64, quantization=method)
    model = llm.llm_engine.runner.model
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoE)
    code = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[method]
    assert moe.w13.dtype == code and moe.w13_scale.shape == moe.w13.shape[:2]
    assert moe.w2.dtype == code and moe.w2_scale.dtype == torch.float32
    assert moe.gate.weight_scale is None and moe.gate.weight.dtype == torch.float32
    if name == "qwen2-moe":
        assert isinstance(moe.shared_expert, LlamaMLP) and moe.shared_expert.gate_up_proj.weight_scale is not None
        assert moe.shared_expert_gate.weight_scale is None
    with pytest.raises(ValueError, match="already quantized"):
        moe.quantize_(method)
    with pytest.raises(ValueError, match="loaded before"):
        moe.weight_loader(moe.w2, torch.zeros(moe.w2.shape), None)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (1, 7, 16, 33)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    hf_q = _fake_quantized_hf(folder, method)
    assert got == [hf_greedy(hf_q, p, 10) for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert got != [hf_greedy(hf, p, 10) for p in prompts]


@pytest.mark.parametrize("spec", [dict(method="ngram", num_speculative_tokens=4),
                                  dict(method="early_exit", num_layers=1, tree=[2, 1, 1]),
                                  dict(method="draft_model", model="self-int8", num_speculative_tokens=3,
                                       quantization="int8")])
def test_speculative_decoding_on_an_moe_target_is_lossless(tmp_path, spec):
    """An MoE target's verify steps (several tokens per sequence through the routed experts, tree
    masks, rejected drafts rolled back) give plain greedy's tokens, for an n-gram proposer, an
    early-exit tree and an INT8 self-draft; no KV block leaks."""
    folder = make_random_hf_folder(tmp_path, CONFIGS["qwen3-moe"])
    if spec.get("model") == "self-int8":
        spec = dict(spec, model=folder)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (3, 17)] + [[5, 6, 7, 8] * 5]
    engine = dict(block_size=4, max_model_len=96, max_num_batched_tokens=32, num_kv_blocks=200)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(folder, **engine).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = LLM(folder, speculative_config=spec, **engine)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == want
    assert llm.llm_engine.kv.num_free_blocks == llm.llm_engine.kv.pool.num_blocks
