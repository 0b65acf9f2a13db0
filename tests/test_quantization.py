"""Weight-only INT8 (quantization="int8"): the codes, the kernels against their reference under the
Triton interpreter, and the engine's greedy output against HF transformers running the same
quantize-dequantized weights."""

import pytest
import torch

from hf_ref import hf_fake_quantized, hf_greedy, make_random_hf_folder
from pageflash import LLM, SamplingParams
from pageflash.kernels.gemv import gemv, gemv_ref
from pageflash.kernels.w8_linear import dequantize_int8, quantize_int8, w8_gemm, w8_linear_ref


def _qw(n, k, seed, scale_rows=True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    if scale_rows:  # rows of very different magnitude: one scale per row must follow them
        w = w * torch.logspace(-3, 1, n)[torch.randperm(n, generator=g)][:, None]
    return w, g


def test_quantize_int8_codes_and_error_bound():
    w, _ = _qw(37, 300, 0)
    w[5] = 0.0  # an all-zero row
    q, s = quantize_int8(w, rows_per_chunk=8)  # several chunks, the last one ragged
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (37,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(q[5], torch.zeros(300, dtype=torch.int8)) and s[5] == 1.0
    amax = w.abs().amax(1)
    nz = amax > 0
    assert torch.allclose(s[nz], amax[nz] / 127)
    # each row's largest entry is exact up to float rounding; every entry within half a step
    err = (dequantize_int8(q, s, torch.float32) - w).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-5) + 1e-12).all()
    # bf16 input: the same codes as its float32 copy
    qb, sb = quantize_int8(w.to(torch.bfloat16))
    q32, s32 = quantize_int8(w.to(torch.bfloat16).float())
    assert torch.equal(qb, q32) and torch.equal(sb, s32)


def test_quantize_int8_rejects_bad_weights():
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.ones(4, dtype=torch.float32))
    with pytest.raises(ValueError, match="2-D float"):
        quantize_int8(torch.ones(2, 2, dtype=torch.int32))
    w = torch.ones(3, 4)
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_int8(w)


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(48, 64), (37, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_int8_matches_reference(m, n, k, dtype):
    w, g = _qw(n, k, m * 100 + n)
    q, s = quantize_int8(w)
    x = torch.randn(m, k, generator=g).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = gemv(x, q, 8, 4, 64, 2, 4, out=out, scale=s)
    ref = w8_linear_ref(x, q, s)
    assert torch.equal(gemv_ref(x, q, s), ref)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert y is out and torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * float(s.max()) * k ** 0.5)


def test_gemv_int8_silu_mul_matches_reference():
    w, g = _qw(2 * 24, 96, 3)
    q, s = quantize_int8(w)
    x = torch.randn(1, 96, generator=g)
    y = gemv(x, q, 8, 4, 32, 2, 4, silu_mul=True, scale=s)
    full = w8_linear_ref(x, q, s)
    ref = torch.nn.functional.silu(full[:, :24]) * full[:, 24:]
    assert y.shape == (1, 24) and torch.allclose(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [5, 17, 40])
@pytest.mark.parametrize("n,k", [(64, 64), (70, 200)])
@pytest.mark.parametrize("cfg", [(16, 16, 32, 1, 4, 1), (32, 32, 64, 2, 4, 2), (16, 32, 32, 2, 4, 1, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w8_gemm_matches_reference(m, n, k, cfg, dtype):
    """Ragged M, N and K against the tile, grouped program order with a partial last group."""
    w, g = _qw(n, k, m * 1000 + n + k)
    q, s = quantize_int8(w)
    x = torch.randn(m, k, generator=g).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = w8_gemm(x, q, s, config=cfg, out=out)
    ref = w8_linear_ref(x, q, s)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert y is out and torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * float(s.max()) * k ** 0.5)


def test_w8_gemm_split_k_with_bias():
    """Split-K partials (K ranges of unequal length: 200 over 3 splits of 32-wide steps), summed,
    then the bias, then one rounding."""
    w, g = _qw(40, 200, 11)
    q, s = quantize_int8(w)
    x = torch.randn(9, 200, generator=g).half()
    b = torch.randn(40, generator=g).half()
    y = w8_gemm(x, q, s, b, config=(16, 16, 32, 1, 4, 1, 3))
    assert torch.allclose(y.float(), w8_linear_ref(x, q, s, b).float(), rtol=2e-3, atol=2e-3)


def test_w8_gemm_bias_float_out_and_strided_x():
    w, g = _qw(40, 64, 9)
    q, s = quantize_int8(w)
    xb = torch.randn(6, 100, generator=g).half()
    x = xb[:, :64]  # rows strided
    b = torch.randn(40, generator=g).half()
    out = torch.full((6, 40), float("nan"), dtype=torch.float32)
    y = w8_gemm(x, q, s, b, config=(16, 16, 32, 1, 4, 1), out=out)
    ref = w8_linear_ref(x, q, s, b)
    assert y.dtype == torch.float32 and torch.allclose(y, ref.float(), rtol=2e-3, atol=2e-3)


def test_w8_gemv_cfg_default_and_env_override(monkeypatch):
    """PAGEFLASH_W8_GEMV_CFG ("rows,r,bk,stages,warps") replaces the INT8 / FP8 GEMV's config for A/Bs;
    a malformed one is an error naming the variable."""
    from pageflash.kernels import w8_linear as w8

    from types import SimpleNamespace

    monkeypatch.delenv("PAGEFLASH_W8_GEMV_CFG", raising=False)
    assert w8.w8_gemv_cfg() == w8._GEMV_CFG == w8.w8_gemv_cfg(torch.device("cpu"))
    # by the peak bandwidth per SM, as the bf16 GEMV's tile: the H200 takes the deeper tile, the H100 not
    h200 = SimpleNamespace(memory_clock_rate=3_201_000, memory_bus_width=6144, multi_processor_count=132)
    h100 = SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120, multi_processor_count=132)
    for i, (props, want) in enumerate(((h200, w8._GEMV_CFG_HIGH_BW), (h100, w8._GEMV_CFG))):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, p=props: p)
        assert w8.w8_gemv_cfg(torch.device("cuda", i)) == want
    monkeypatch.setenv("PAGEFLASH_W8_GEMV_CFG", "16,8,1024,3,4")
    assert w8.w8_gemv_cfg() == (16, 8, 1024, 3, 4)
    for bad in ("8,8,512,4", "8,6,512,4,4", "8,8,500,4,4", "8,8,512,0,4", "12,8,512,4,4", "x"):
        monkeypatch.setenv("PAGEFLASH_W8_GEMV_CFG", bad)
        with pytest.raises(ValueError, match="PAGEFLASH_W8_GEMV_CFG"):
            w8.w8_gemv_cfg()


def test_w8_kernels_reject_bad_inputs():
    q, s = quantize_int8(torch.randn(8, 16))
    with pytest.raises(ValueError, match="K=16"):
        w8_gemm(torch.randn(5, 12), q, s)
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn q"):
        w8_gemm(torch.randn(5, 16), q.float(), s)
    with pytest.raises(ValueError, match="float32 s"):
        w8_gemm(torch.randn(5, 16), q, s.half())
    with pytest.raises(ValueError, match="bias"):
        w8_gemm(torch.randn(5, 16), q, s, torch.zeros(7))
    with pytest.raises(ValueError, match="out must be"):
        w8_gemm(torch.randn(5, 16), q, s, out=torch.empty(5, 7))
    with pytest.raises(ValueError, match="scale"):
        gemv(torch.randn(1, 16), q, 8, 4, 16, 1, 4, scale=s[:4])
    with pytest.raises(ValueError, match="scale"):
        gemv(torch.randn(1, 16), q.float(), 8, 4, 16, 1, 4, scale=s)


# ---- the engine ------------------------------------------------------------------------------------

CFG = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
           rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="qwen2", architectures=["Qwen2ForCausalLM"],
           num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0)


@pytest.mark.parametrize("method,code", [("int8", torch.int8), ("fp8", torch.float8_e4m3fn)])
def test_engine_quantized_greedy_matches_hf_on_fake_quantized_weights(tmp_path, method, code):
    """A Qwen2 (q/k/v biases) with the projections in int8 / e4m3: greedy equals HF over the dequantized
    codes through chunked prefill and preemption (on CPU every product is the dequantized weight); the
    codes differ from the float weights enough that the float model's output is a different sequence
    (so the quantization is really applied)."""
    from transformers import AutoModelForCausalLM

    folder = make_random_hf_folder(tmp_path, CFG, std=0.3)
    hf_q = hf_fake_quantized(folder, method)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 211, (n,), generator=g).tolist() for n in (1, 7, 16, 33)]
    llm = LLM(folder, quantization=method, block_size=4, max_num_batched_tokens=24, max_model_len=96,
              num_kv_blocks=24)
    layer = llm.llm_engine.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == code
    assert layer.mlp.down_proj.weight_scale.dtype == torch.float32
    assert llm.llm_engine.runner.model.lm_head.weight.dtype == torch.float32  # the head is kept
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(hf_q, p, 24) for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert got != [hf_greedy(hf, p, 24) for p in prompts]
    assert llm.llm_engine.kv.num_free_blocks == 24


def test_quantization_bad_values_and_layer_state():
    with pytest.raises(ValueError, match="quantization must be None or one of"):
        LLM("smollm2-135m", quantization="awq")
    from pageflash.layers.linear import Linear

    lin = Linear(16, 8)
    lin.weight.data.normal_()
    with pytest.raises(ValueError, match="quantization must be one of"):
        lin.quantize_("int4")
    lin.quantize_("int8")
    with pytest.raises(ValueError, match="already quantized"):
        lin.quantize_("int8")
    with pytest.raises(ValueError, match="before the layer is quantized"):
        lin.weight_loader(lin.weight, torch.zeros(8, 16))
    x = torch.randn(3, 16)
    assert torch.allclose(lin(x), w8_linear_ref(x, lin.weight, lin.weight_scale), rtol=1e-5, atol=1e-5)


def test_roofline_counts_quantized_bytes():
    from pageflash.bench.roofline import matmul_params, step_weight_bytes

    llm = LLM("smollm2-135m", load_format="dummy", max_model_len=64, num_kv_blocks=8, dtype="bfloat16")
    m = llm.llm_engine.runner.model
    cfg = llm.llm_engine.model_config
    assert step_weight_bytes(m) == 2 * matmul_params(cfg)
    layer_params = sum(p.numel() for lin in m.layers.modules() if hasattr(lin, "weight_scale")
                       for p in [lin.weight])
    m.quantize_("int8")
    rows = sum(lin.weight.shape[0] for lin in m.layers.modules() if getattr(lin, "weight_scale", None) is not None)
    assert step_weight_bytes(m) == 2 * matmul_params(cfg) - layer_params + 4 * rows
