"""Mixtures of experts on CUDA: the fused MoE kernels in bf16 at real layer shapes against the float32
reference, inside a CUDA graph with the routing changed between replays, and the engine's greedy
tokens (float32, Triton attention, decode graphs) against HF transformers on the GPU."""

import sys
from pathlib import Path

import pytest
import torch

from pageflash import LLM, SamplingParams
from pageflash.kernels.fused_moe import fused_moe
from pageflash.layers.moe import experts_ref, route

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "qwen1.5-moe": (2048, 1408, 60, 4), "mixtral-like": (4096, 2048, 8, 2)}


def _layer(h, inter, e, g):
    w13 = (torch.randn(e, 2 * inter, h, device="cuda", generator=g) * 0.03).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, device="cuda", generator=g) * 0.03).to(torch.bfloat16)
    return w13, w2


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("t", [1, 2, 5, 64, 300, 2048])
def test_fused_moe_bf16(shape, t, poison_outputs):
    h, inter, e, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(t)
    w13, w2 = _layer(h, inter, e, g)
    x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    wts, ids = route(torch.randn(t, e, device="cuda", generator=g), k, True)
    out = fused_moe(x, w13, w2, wts, ids)
    ref = experts_ref(x.float(), w13.float(), w2.float(), wts, ids)
    assert not torch.isnan(out).any()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("t", [24, 1])  # the 32-row and the 16-row (decode) tile configs
def test_fused_moe_in_a_cuda_graph_follows_the_routing(t):
    h, inter, e, k = SHAPES["qwen3-30b-a3b"]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13, w2 = _layer(h, inter, e, g)
    x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    wts, ids = route(torch.randn(t, e, device="cuda", generator=g), k, True)
    out = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fused_moe(x, w13, w2, wts, ids, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe(x, w13, w2, wts, ids, out=out)
    for seed in range(3):  # new routings (one with every token on the same experts), same buffers
        gg = torch.Generator(device="cuda").manual_seed(100 + seed)
        w_new, i_new = route(torch.randn(t, e, device="cuda", generator=gg), k, True)
        if seed == 2:
            i_new[:] = i_new[0]
        wts.copy_(w_new)
        ids.copy_(i_new)
        x.copy_(torch.randn(t, h, device="cuda", generator=gg).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_moe(x, w13, w2, wts, ids))


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_engine_matches_hf_on_cuda_fp32(tmp_path, name):
    """Greedy tokens through the fused MoE kernels, Triton attention and decode graphs equal HF's
    (float32; HF on the CPU), with chunked prefill and a batch that the graphs pad."""
    from transformers import AutoModelForCausalLM

    from hf_ref import hf_greedy, make_random_hf_folder
    from test_engine_hf import CONFIGS

    folder = make_random_hf_folder(tmp_path, CONFIGS[name])
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()  # on the CPU
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (1, 5, 16, 17, 33, 40, 3)]
    llm = LLM(folder, dtype="float32", block_size=16, max_num_batched_tokens=32, max_model_len=128,
              num_kv_blocks=64)
    assert llm.llm_engine.runner.graphs is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16)


def _quantized_layer(shape, t, method):
    """(k, w13 codes, w2 codes, their scales [E, rows], bf16 x [t, H], router logits) of a random layer."""
    from pageflash.layers.linear import quantize_weight

    h, inter, e, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(t)
    w13, w2 = _layer(h, inter, e, g)
    q13, s13 = quantize_weight(w13.reshape(-1, h), method)
    q2, s2 = quantize_weight(w2.reshape(-1, inter), method)
    x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    logits = torch.randn(t, e, device="cuda", generator=g)
    return k, q13.view(w13.shape), q2.view(w2.shape), s13.view(e, -1), s2.view(e, -1), x, logits


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-like"])
@pytest.mark.parametrize("t", [1, 2, 64, 2048])
def test_int8_experts_bf16(shape, t, poison_outputs):
    """INT8 experts (codes widened in registers, a scale per row) against the float32 reference over
    the dequantized weights."""
    from pageflash.kernels.fused_moe import routed_moe

    k, q13, q2, s13, s2, x, logits = _quantized_layer(shape, t, "int8")
    out = routed_moe(x, logits, q13, q2, k, True, w13_scale=s13, w2_scale=s2)
    wts, ids = route(logits, k, True)
    ref = experts_ref(x.float(), q13, q2, wts, ids, s13, s2)
    assert not torch.isnan(out).any()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-like"])
@pytest.mark.parametrize("t", [1, 2, 64, 512, 2048])
@pytest.mark.parametrize("fast", ["1", "0"])
def test_fp8_w8a8_experts_bf16(shape, t, fast, poison_outputs, monkeypatch):
    """e4m3 experts W8A8 (activation rows quantized, e4m3 x e4m3 on the tensor cores) against the
    W8A8 reference (float32 products of the same codes), with the tensor cores' FP8 accumulation
    (PAGEFLASH_FP8_FAST_ACCUM=1, the default) or float32 sums (0), and weight-only against the
    dequantized reference; the automatic choice on this GPU is W8A8 (compute capability >= 8.9)."""
    monkeypatch.setenv("PAGEFLASH_FP8_FAST_ACCUM", fast)
    from pageflash.kernels.fused_moe import routed_moe, w8a8_applies

    k, q13, q2, s13, s2, x, logits = _quantized_layer(shape, t, "fp8")
    wts, ids = route(logits, k, True)
    for w8a8 in (True, False):
        out = routed_moe(x, logits, q13, q2, k, True, w13_scale=s13, w2_scale=s2, w8a8=w8a8)
        ref = experts_ref(x.float() if not w8a8 else x, q13, q2, wts, ids, s13, s2, w8a8=w8a8)
        assert not torch.isnan(out).any()
        tol = 3e-2 if w8a8 and fast == "1" else 1e-2
        assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < tol, w8a8
    assert w8a8_applies(x, q13) == (torch.cuda.get_device_capability() >= (8, 9))


@pytest.mark.parametrize("name", ["qwen2-moe", "qwen3-moe"])
def test_engine_int8_experts_match_fake_quantized_hf_fp32(tmp_path, name):
    """quantization="int8" on CUDA (INT8 grouped GEMMs, decode graphs) equals HF over the dequantized
    codes (float32; HF on the CPU)."""
    from hf_ref import hf_greedy, make_random_hf_folder
    from test_engine_hf import CONFIGS
    from test_moe import _fake_quantized_hf

    folder = make_random_hf_folder(tmp_path, CONFIGS[name], std=0.3)
    hf_q = _fake_quantized_hf(folder)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (1, 7, 16, 33)]
    llm = LLM(folder, dtype="float32", quantization="int8", max_model_len=128, num_kv_blocks=64)
    assert llm.llm_engine.runner.model.layers[0].mlp.w13.dtype == torch.int8
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_q, p, 12)
