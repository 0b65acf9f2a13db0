"""FP8 weights (quantization="fp8") on CUDA: the activation quantizer and the dispatch at llama-3-8b
shapes in bf16 against the float32 references (weight-only below PAGEFLASH_FP8_MM_M rows, W8A8
through torch._scaled_mm from there), and the engine through them."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import test_quant_gpu  # noqa: E402
from near_ties import assert_parts_only_at_near_ties  # noqa: E402
from pageflash import LLM, SamplingParams  # noqa: E402
from pageflash.kernels import fp8_linear as F8  # noqa: E402
from pageflash.kernels.w8_linear import w8_linear_ref  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "down": (4096, 14336)}


def _close(y, ref, rel=1e-2):
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.float().abs().max().item() + 1e-3, err


def _close_w8a8(y, ref):
    """FP8 tensor-core sums over long K differ from the float32 reference's by more than a 16-bit
    product's (run 54: up to 1.5% of the largest output at K 14336, where one differing activation code
    at a rounding tie also moves a row); the mean difference stays at rounding level."""
    d = (y.float() - ref.float()).abs()
    top = ref.float().abs().max().item()
    assert d.max().item() <= 3e-2 * top + 1e-3, d.max().item()
    assert d.mean().item() <= 2e-3 * top, d.mean().item()


@pytest.mark.parametrize("k", [4096, 14336, 4136])
def test_quantize_rows_equals_reference_bf16(k, poison_outputs):
    g = torch.Generator(device="cuda").manual_seed(k)
    x = (torch.randn(77, k, device="cuda", generator=g) * 3).to(torch.bfloat16)
    x[3] = 0
    q, s = F8.quantize_rows_fp8(x)
    rq, rs = F8.quantize_rows_fp8_ref(x)
    assert torch.equal(s, rs)
    # the codes' values equal torch's; only a negative number that rounds to zero may come out +0.0
    # where torch writes -0.0 (run 54: one code in 3 x 10^5)
    assert torch.equal(q.float(), rq.float())


@pytest.mark.parametrize("m", [1, 2, 3, 16, 31, 32, 33, 64, 65, 128, 129, 300, 1024])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fp8_linear_bf16_matches_reference(m, shape, poison_outputs):
    """Every dispatch range: the GEMV (M <= 2), the Triton W8A8 kernel (3..128), torch._scaled_mm."""
    n, k = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(m)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    q, s = F8.quantize_fp8(w)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    w8a8 = m >= F8._mm_min_m()
    ref = F8.fp8_scaled_mm_ref(x, q, s) if w8a8 else w8_linear_ref(x.float(), q, s)
    close = _close_w8a8 if w8a8 else _close
    y = F8.fp8_linear(x, q, s)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    close(y, ref)
    yf = F8.fp8_linear(x, q, s, float_out=True)
    assert yf.dtype == torch.float32
    close(yf, ref)
    close(F8.fp8_linear(x, q, s, b), ref.float() + b.float())
    if w8a8:  # the activations' codes cost more than the kernel's rounding: the paths are told apart
        wo = w8_linear_ref(x.float(), q, s)
        assert (y.float() - ref.float()).abs().mean() < (wo - ref.float()).abs().mean()


@pytest.mark.parametrize("cfg", [None, (64, 16, 256, 1, 4, 4), (128, 16, 256, 1, 4, 3), (64, 64, 128, 1, 4, 3),
                                 (128, 128, 128, 1, 8, 3), (64, 128, 256, 1, 8, 4), (64, 32, 128, 3, 4, 4)])
def test_fp8_mm_configs_bias_and_ragged_shapes(cfg, poison_outputs):
    """The Triton W8A8 kernel over its tile configs (split K included), ragged M / N / K, a bias."""
    g = torch.Generator(device="cuda").manual_seed(7)
    for m, n, k in ((5, 1000, 4096), (77, 6144, 4112), (130, 4096, 14336)):
        q, s = F8.quantize_fp8(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        _close_w8a8(F8.fp8_mm(x, q, s, b, config=cfg), F8.fp8_scaled_mm_ref(x, q, s, b))


@pytest.mark.parametrize("m", [3, 64, 128])
def test_fp8_mm_float32_sums_at_long_k(m, poison_outputs, monkeypatch):
    """PAGEFLASH_FP8_FAST_ACCUM=0: fp8_mm adds each K tile's e4m3 dot to a float32 sum, and at K 14336
    its output stays within bf16 rounding of the float32 reference; the default (the tensor cores'
    FP8 accumulation over the whole loop) within _close_w8a8's bound."""
    g = torch.Generator(device="cuda").manual_seed(m)
    q, s = F8.quantize_fp8(torch.randn(4096, 14336, device="cuda", generator=g) * 0.02)
    x = torch.randn(m, 14336, device="cuda", generator=g).to(torch.bfloat16)
    ref = F8.fp8_scaled_mm_ref(x, q, s)
    _close_w8a8(F8.fp8_mm(x, q, s), ref)
    monkeypatch.setenv("PAGEFLASH_FP8_FAST_ACCUM", "0")
    d = (F8.fp8_mm(x, q, s).float() - ref.float()).abs()
    assert d.max().item() <= 2 ** -7 * ref.float().abs().max().item(), d.max().item()


def test_fp16_and_fp32_activations_stay_weight_only():
    g = torch.Generator(device="cuda").manual_seed(2)
    q, s = F8.quantize_fp8(torch.randn(1024, 4096, device="cuda", generator=g) * 0.02)
    for dt in (torch.float16, torch.float32):
        x = torch.randn(256, 4096, device="cuda", generator=g).to(dt)
        assert not F8.scaled_mm_applies(x, q)
        _close(F8.fp8_linear(x, q, s), w8_linear_ref(x.float(), q, s))


def _codes_agree(q, s, rq, rs):
    """The codes and scales a norm's launch wrote for the next FP8 product (scale_out) against
    quantize_rows_fp8 of the unquantized launch's output. The activation's are equal. The norm's may
    part in rare elements: the two are separate compiles of one kernel, and the e4m3 store's layout can
    change the order of the sum of squares, so an output element may round the other way (an H200
    run of gemma-3-1b: one code in 560k). Each element dequantizes within one e4m3 step of the other."""
    same = (q.float() == rq.float()).float().mean().item()
    assert same >= 0.9999, same
    assert torch.allclose(s, rs, rtol=2 ** -7, atol=0)
    a, b = q.float() * s, rq.float() * rs
    assert ((a - b).abs() <= 2 ** -3 * torch.maximum(a.abs(), b.abs()) + 2 ** -9 * rs).all()


@pytest.mark.parametrize("m", [3, 64, 300])
def test_norm_and_activation_fp8_codes_equal_quantizer_bf16(m, poison_outputs):
    """The RMSNorm (+ residual; Gemma's sandwich form) and SiLU / GELU-and-mul launches that write e4m3
    codes for the next product (scale_out) against quantize_rows_fp8 of their own unquantized output,
    at llama-3-8b and gemma-3-1b widths; 28672 columns take the two-pass activation."""
    from pageflash.kernels.activation import gelu_tanh_and_mul, silu_and_mul
    from pageflash.kernels.rms_norm import rms_norm

    g = torch.Generator(device="cuda").manual_seed(m)
    for h, kw in ((4096, {}), (1152, {"unit_offset": True, "pre": True})):
        x, r = (torch.randn(2, m, h, device="cuda", generator=g) * 2).to(torch.bfloat16)
        w, pw = (torch.rand(2, h, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
        kw = dict(kw, pre_weight=pw) if kw.pop("pre", False) else kw
        y, res = rms_norm(x, w, 1e-5, r, **kw)
        s = torch.empty(m, 1, device="cuda")
        q, res2 = rms_norm(x, w, 1e-5, r, scale_out=s, **kw)
        assert torch.equal(res, res2)
        _codes_agree(q, s, *F8.quantize_rows_fp8(y))
    for inter, act in ((14336, silu_and_mul), (28672, silu_and_mul), (14336, gelu_tanh_and_mul),
                       (6912, gelu_tanh_and_mul)):
        gu = (torch.randn(m, 2 * inter, device="cuda", generator=g) * 2).to(torch.bfloat16)
        s = torch.empty(m, 1, device="cuda")
        q = act(gu, scale_out=s)
        rq, rs = F8.quantize_rows_fp8(act(gu))
        assert torch.equal(s, rs) and torch.equal(q.float(), rq.float()), (inter, act.__name__)


@pytest.mark.parametrize("model", ["smollm2-135m", "gemma-3-1b"])
def test_engine_fused_fp8_quantization_bf16(model, monkeypatch):
    """The norms and the activation hand the FP8 products their input's codes (Fp8Rows) instead of
    each product quantizing it in its own launch (PAGEFLASH_FP8_FUSED_QUANT=0): eager steps then
    quantize only the attention output (o_proj) themselves, and the tokens are those of the separate
    quantizer, eager and in the decode graphs, up to near-ties (the norm's rare other rounding:
    _codes_agree; Gemma's dummy logits are flat). Gemma: sandwich norms, GeGLU."""
    calls = []
    real = F8.quantize_rows_fp8
    monkeypatch.setattr(F8, "quantize_rows_fp8", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    fused_eager, _, _ = run(model, dtype="bfloat16", enforce_eager=True)
    n_fused = len(calls)
    fused_graphs, llm, _ = run(model, dtype="bfloat16")
    assert llm.llm_engine.runner.graphs is not None
    monkeypatch.setenv("PAGEFLASH_FP8_FUSED_QUANT", "0")
    calls.clear()
    sep_eager, _, lps = run(model, dtype="bfloat16", enforce_eager=True, logprobs=5)
    n_sep = len(calls)
    sep_graphs, _, glps = run(model, dtype="bfloat16", logprobs=5)
    assert 0 < n_fused and n_sep == 4 * n_fused, (n_fused, n_sep)
    assert_parts_only_at_near_ties(fused_eager, sep_eager, lps, max_parted=2)
    assert_parts_only_at_near_ties(fused_graphs, sep_graphs, glps, max_parted=2)


def run(model="smollm2-135m", logprobs=None, max_tokens=24, **kw):
    return test_quant_gpu.run(model, logprobs, "fp8", max_tokens, **kw)


def test_engine_w8a8_prefill_agrees_with_weight_only(monkeypatch):
    """bf16, first tokens: prompts prefilled through W8A8 (>= 32 rows) pick a token the weight-only
    path ranks in its top 5, and mostly the same one (activation codes move the logits a little)."""
    w8a8, _, _ = run(dtype="bfloat16", max_tokens=1)
    monkeypatch.setenv("PAGEFLASH_FP8_MM_M", str(1 << 30))
    wo, _, lps = run(dtype="bfloat16", max_tokens=1, logprobs=5)
    assert all(a[0] in lp[0] for a, lp in zip(w8a8, lps))
    assert sum(a == b for a, b in zip(w8a8, wo)) >= 6


def test_fp8_checkpoint_runs_as_quantizing_at_load_bf16(tmp_path):
    """A per-channel FP8 checkpoint (compressed-tensors layout) holding quantize_fp8's own codes and
    scales of a 16-bit model runs exactly as that model with quantization="fp8": staged loading, decode
    graphs and W8A8 prefill give the same tokens, and the engines hold the same codes."""
    import glob
    import json
    import os

    from safetensors.torch import load_file, save_file

    from hf_ref import make_random_hf_folder

    cfg = dict(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
               max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama",
               architectures=["LlamaForCausalLM"], num_attention_heads=8, num_key_value_heads=2, rope_theta=10000.0)
    src = make_random_hf_folder(tmp_path / "src", cfg, std=0.05)
    dst = tmp_path / "fp8"
    os.makedirs(dst)
    sd = {}
    for f in glob.glob(os.path.join(src, "*.safetensors")):
        sd.update(load_file(f))
    out = {}
    for name, t in sd.items():
        if name.endswith("_proj.weight") and ".layers." in name:
            q, s = F8.quantize_fp8(t.to(torch.bfloat16))  # what the engine makes of the bf16 weight
            out[name], out[name[: -len("weight")] + "weight_scale"] = q, s.view(-1, 1)
        else:
            out[name] = t
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    c = json.load(open(os.path.join(src, "config.json")))
    c["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
    json.dump(c, open(os.path.join(dst, "config.json"), "w"))
    prompts = [[(3 * i + j) % 997 + 1 for j in range(n)] for i, n in enumerate((5, 40, 100, 1, 64))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for folder, quant in ((src, "fp8"), (str(dst), None)):
        llm = LLM(folder, dtype="bfloat16", quantization=quant, max_model_len=256, num_kv_blocks=128)
        assert llm.llm_engine.runner.graphs is not None
        w = llm.llm_engine.runner.model.layers[2].mlp.down_proj
        runs.append(([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                  params, use_tqdm=False)],
                     w.weight.view(torch.uint8).clone(), w.weight_scale.clone()))
        del llm
    assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2])
    assert runs[0][0] == runs[1][0]
