"""Weight-only INT8 on CUDA: the kernels at llama-3-8b shapes in bf16 against the float32 reference,
and the engine's greedy output through them against the dequantize-then-F.linear path."""

import pytest
import torch

from pageflash import LLM, SamplingParams
from pageflash.kernels.gemv import gemv
from pageflash.kernels.w8_linear import quantize_int8, w8_linear, w8_linear_ref

SHAPES = {"qkv": (6144, 4096), "down": (4096, 14336)}


def _close(y, ref):
    err = (y.float() - ref).abs().max().item()
    assert err <= 1e-2 * ref.abs().max().item() + 1e-3, err


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16, 17, 33, 64, 100, 128, 300, 1024])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_w8_linear_bf16_matches_reference(m, shape, poison_outputs):
    n, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    q, s = quantize_int8(w)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    ref = w8_linear_ref(x.float(), q, s)
    y = w8_linear(x, q, s)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    _close(y, ref)
    yf = w8_linear(x, q, s, float_out=True)
    assert yf.dtype == torch.float32
    _close(yf, ref)
    _close(w8_linear(x, q, s, b), ref + b.float())


def test_gemv_int8_silu_bf16_matches_reference(poison_outputs):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(2 * 14336, 4096, device="cuda", generator=g) * 0.02
    q, s = quantize_int8(w)
    x = torch.randn(1, 4096, device="cuda", generator=g).to(torch.bfloat16)
    full = w8_linear_ref(x.float(), q, s)
    ref = torch.nn.functional.silu(full[:, :14336]) * full[:, 14336:]
    y = gemv(x, q, 16, 8, 512, 4, 4, silu_mul=True, scale=s)
    assert y.shape == (1, 14336)
    _close(y, ref)


PROMPTS = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33, 64, 100, 1, 250, 16))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(model="smollm2-135m", **kw):
    llm = LLM(model, load_format="dummy", max_model_len=512, num_kv_blocks=512, quantization="int8", **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("model", ["smollm2-135m", "qwen3-0.6b"])
def test_engine_int8_kernels_equal_dequant_path_fp32(model, monkeypatch):
    """The INT8 GEMV / GEMM in the decode graphs and prefill give the tokens of dequantized weights
    through F.linear, eager (float32: both sides exact up to summation order)."""
    fast, llm = run(model, dtype="float32")
    assert llm.llm_engine.runner.graphs is not None
    assert llm.llm_engine.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    monkeypatch.setenv("PAGEFLASH_W8_KERNELS", "0")
    ref, _ = run(model, dtype="float32", enforce_eager=True)
    assert fast == ref


def test_engine_int8_graphs_equal_eager_bf16():
    eager, _ = run(dtype="bfloat16", enforce_eager=True)
    graphs, llm = run(dtype="bfloat16")
    assert llm.llm_engine.runner.graphs is not None
    assert graphs == eager


def test_dequantize_fast_equals_reference_and_split_k(poison_outputs):
    from pageflash.kernels.w8_linear import dequantize_int8, dequantize_int8_fast, w8_gemm

    g = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(6144, 4096 + 40, device="cuda", generator=g) * 0.02  # K not a multiple of the block
    q, s = quantize_int8(w)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(dequantize_int8_fast(q, s, dt), dequantize_int8(q, s, dt))
    x = torch.randn(100, 4136, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(6144, device="cuda", generator=g).to(torch.bfloat16)
    ref = w8_linear_ref(x.float(), q, s) + b.float()
    for split in (2, 4):
        _close(w8_gemm(x, q, s, b, config=(64, 128, 128, 1, 4, 3, split)), ref)


def test_w8_linear_bias_rounds_once_at_every_batch_size():
    """A biased projection (Qwen2's qkv) gives a row the same bits at batch 1, 2 and 3: the bias is
    added in float32 before the one rounding on every path (the GEMV takes only unbiased rows)."""
    g = torch.Generator(device="cuda").manual_seed(9)
    w = torch.randn(1024, 4096, device="cuda", generator=g) * 0.02
    q, s = quantize_int8(w)
    x = torch.randn(3, 4096, device="cuda", generator=g).to(torch.bfloat16)
    b = (torch.randn(1024, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    ys = [w8_linear(x[:m], q, s, b) for m in (1, 2, 3)]
    assert torch.equal(ys[0][0], ys[1][0]) and torch.equal(ys[1][0], ys[2][0])
    assert w8_linear(x[:0], q, s).shape == (0, 1024)
