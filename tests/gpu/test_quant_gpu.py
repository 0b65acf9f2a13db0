"""Weight-only INT8 on CUDA: the kernels at llama-3-8b shapes in bf16 against the float32 reference,
and the engine's greedy output through them against the dequantize-then-F.linear path."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from near_ties import assert_parts_only_at_near_ties  # noqa: E402
from pageflash import LLM, SamplingParams  # noqa: E402
from pageflash.kernels.gemv import gemv  # noqa: E402
from pageflash.kernels.w8_linear import quantize_int8, w8_linear, w8_linear_ref  # noqa: E402

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


@pytest.mark.parametrize("code", ["int8", "e4m3"])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k,cfg", [(6144, 4096, (8, 8, 512, 4, 4)), (4096, 14336, (16, 16, 512, 3, 4)),
                                     (1000, 1000, (8, 8, 1024, 3, 4)), (37, 260, (8, 4, 2048, 2, 4))])
def test_gemv_code_words_equal_per_code_loads(code, m, n, k, cfg, monkeypatch, poison_outputs):
    """The 8-bit GEMV's word path (4 codes per int32, gemv.i8x4_to_f32 / e4m3x4_to_f32) against the
    per-code path (PAGEFLASH_CODE_WORDS=0) and the float32 reference: K tails inside a tile, ragged N,
    M 1-4, the fused SiLU; codes that are not whole words take the per-code path."""
    from pageflash.kernels.fp8_linear import quantize_fp8
    from pageflash.kernels.gemv import code_words

    g = torch.Generator(device="cuda").manual_seed(n + k + m)
    q, s = (quantize_int8 if code == "int8" else quantize_fp8)(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    assert code_words(q) == (1 if code == "int8" else 2) and not code_words(q[:, 1:]) and not code_words(q[:, : k - 2])
    ref = w8_linear_ref(x.float(), q, s)
    y = gemv(x, q, *cfg, scale=s)
    _close(y, ref)
    monkeypatch.setenv("PAGEFLASH_CODE_WORDS", "0")
    y0 = gemv(x, q, *cfg, scale=s)
    monkeypatch.delenv("PAGEFLASH_CODE_WORDS")
    _close(y0, ref)
    assert ((y.float() - y0.float()).abs() <= y0.float().abs() * 2**-7 + 1e-6).all()  # a bf16 rounding apart at most
    sub = q[:, : k - 2]  # not whole words (and a strided view)
    _close(gemv(x[:, : k - 2], sub, *cfg, scale=s), w8_linear_ref(x[:, : k - 2].float(), sub, s))
    if n % 2 == 0 and cfg[0] % (2 * cfg[1]) == 0:
        ref2 = torch.nn.functional.silu(ref[:, : n // 2]) * ref[:, n // 2:]
        _close(gemv(x, q, *cfg, silu_mul=True, scale=s), ref2)


PROMPTS = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33, 64, 100, 1, 250, 16))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(model="smollm2-135m", logprobs=None, quantization="int8", max_tokens=24, **kw):
    """(token ids per prompt, the engine, per-position logprob dicts per prompt or None); also
    tests/gpu/test_fp8_gpu.py's."""
    llm = LLM(model, load_format="dummy", max_model_len=512, num_kv_blocks=512, quantization=quantization, **kw)
    params = dataclasses.replace(GREEDY, logprobs=logprobs, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm, [o.outputs[0].logprobs for o in outs]


CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


@pytest.mark.parametrize("method", sorted(CODES))
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen3-0.6b"])
def test_engine_quantized_kernels_equal_dequant_path_fp32(model, method, monkeypatch):
    """The INT8 / FP8 weight-only GEMV / GEMM (float32 activations never take FP8's W8A8 path) in the
    decode graphs and prefill give the tokens of dequantized weights through F.linear, eager (float32:
    both sides exact up to summation order)."""
    fast, llm, _ = run(model, quantization=method, dtype="float32")
    assert llm.llm_engine.runner.graphs is not None
    assert llm.llm_engine.runner.model.layers[0].mlp.down_proj.weight.dtype == CODES[method]
    monkeypatch.setenv("PAGEFLASH_W8_KERNELS", "0")
    ref, _, _ = run(model, quantization=method, dtype="float32", enforce_eager=True)
    assert fast == ref


@pytest.mark.parametrize("method", sorted(CODES))
def test_engine_quantized_graphs_equal_eager_bf16(method):
    """bf16: the decode graphs (attention planned for the longest context) and eager steps (planned for
    each step's) give the same tokens up to near-ties. On 2026-11-27 one row of eight parted for one
    token inside a run of repeats (dummy weights), as tests/gpu/test_lora_gpu.py's bf16 rows may."""
    eager, _, lps = run(quantization=method, dtype="bfloat16", enforce_eager=True, logprobs=5)
    graphs, llm, _ = run(quantization=method, dtype="bfloat16")
    assert llm.llm_engine.runner.graphs is not None
    assert_parts_only_at_near_ties(graphs, eager, lps, max_parted=2)


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


def test_checkpoint_quantized_layer_by_layer_keeps_peak_memory_low(tmp_path):
    """A checkpoint loaded with quantization="int8" reaches the GPU one decoder layer at a time,
    quantized on arrival: the peak GPU memory while the engine starts stays well under the model's
    bf16 size, and greedy decoding (float32) equals HF transformers over the same dequantized codes."""
    from hf_ref import make_random_hf_folder
    from transformers import AutoModelForCausalLM

    cfg = dict(vocab_size=8000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
               max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama",
               architectures=["LlamaForCausalLM"], num_attention_heads=16, num_key_value_heads=4,
               rope_theta=10000.0)
    folder = make_random_hf_folder(tmp_path, cfg, std=0.05)
    layer_params = 4 * 1024 * 1024 // 2 + 1024 * 1024 + 3 * 1024 * 4096  # q, k, v, o (4 KV heads of 16), MLP
    fp32_bytes = 4 * (8 * layer_params + 2 * 8000 * 1024)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    llm = LLM(folder, quantization="int8", dtype="float32", num_kv_blocks=64, max_model_len=256,
              enforce_eager=True)
    peak = torch.cuda.max_memory_allocated() - base
    # int8 layers (1 byte / param) + float32 embedding and head + one float32 layer in flight + KV cache
    assert peak < 0.75 * fp32_bytes, (peak, fp32_bytes)  # loaded whole it would exceed fp32_bytes
    assert llm.llm_engine.runner.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().cuda()
    with torch.no_grad():
        for mod in hf.model.layers.modules():
            if isinstance(mod, torch.nn.Linear):
                q, s = quantize_int8(mod.weight)
                mod.weight.copy_(q.float() * s[:, None])
    prompts = [[(5 * i + j) % 8000 for j in range(n)] for i, n in enumerate((3, 17, 40))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                          do_sample=False, pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
