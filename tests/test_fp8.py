"""FP8 weights (quantization="fp8"): the e4m3 codes, the activation quantizer kernel and the 8-bit
kernels over e4m3 codes against their references under the Triton interpreter, the W8A8 reference
against torch's own FP8 ``_scaled_mm`` (CPU). The engine against HF transformers over the
quantize-dequantized weights: tests/test_quantization.py (both methods). The W8A8 dispatch itself runs
on CUDA only (tests/gpu/test_fp8_gpu.py)."""

import pytest
import torch

from pageflash import LLM
from pageflash.kernels.fp8_linear import (FP8, fp8_linear, fp8_mm, fp8_scaled_mm, fp8_scaled_mm_ref, quantize_fp8,
                                          quantize_rows_fp8, quantize_rows_fp8_ref, scaled_mm_applies)
from pageflash.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from pageflash.kernels.fp8_quant import Fp8Rows
from pageflash.kernels.gemv import gemv
from pageflash.kernels.rms_norm import rms_norm
from pageflash.kernels.w8_linear import dequantize_int8, w8_gemm, w8_linear_ref


def _w(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitude: one scale per row must follow them
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n)[torch.randperm(n, generator=g)][:, None]
    return w, g


def _bits(t):
    return t.view(torch.uint8)


def test_quantize_fp8_codes_and_error_bound():
    w, _ = _w(37, 300, 0)
    w[5] = 0.0  # an all-zero row
    q, s = quantize_fp8(w, rows_per_chunk=8)  # several chunks, the last one ragged
    assert q.dtype == FP8 and s.dtype == torch.float32 and q.shape == w.shape and s.shape == (37,)
    assert float(q.float().abs().max()) == 448.0
    assert torch.equal(q[5].float(), torch.zeros(300)) and s[5] == 1.0
    amax = w.abs().amax(1)
    nz = amax > 0
    assert torch.allclose(s[nz], amax[nz] / 448)
    # e4m3: 3 mantissa bits -> relative error <= 2**-4 for normals (|y| >= 2**-6), <= 2**-10 absolute below
    y = w / s[:, None]
    err = (q.float() - y).abs()
    assert (err <= torch.maximum(y.abs() * 2 ** -4, torch.full_like(y, 2 ** -10)) * (1 + 1e-6)).all()
    # round to nearest even, as torch's own conversion: the codes are torch's
    assert torch.equal(_bits(q), _bits((w / s[:, None]).clamp(-448, 448).to(FP8)))
    # bf16 input: the same codes as its float32 copy
    qb, sb = quantize_fp8(w.to(torch.bfloat16))
    q32, s32 = quantize_fp8(w.to(torch.bfloat16).float())
    assert torch.equal(_bits(qb), _bits(q32)) and torch.equal(sb, s32)


def test_quantize_fp8_rejects_bad_weights():
    with pytest.raises(ValueError, match="2-D float"):
        quantize_fp8(torch.ones(4))
    w = torch.ones(3, 4)
    w[2, 1] = float("inf")
    with pytest.raises(ValueError, match="inf or nan"):
        quantize_fp8(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("max_tile", [8192, 64])  # one pass over a row, or two (amax, then codes)
def test_quantize_rows_kernel_equals_reference(dtype, max_tile):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 300, generator=g) * torch.logspace(-4, 2, 6)[:, None]).to(dtype)
    x[2] = 0.0  # an all-zero row: scale 1, zero codes
    x[4, 7] = 1e-6  # far below the row's scale: e4m3 subnormals / zero
    q, s = quantize_rows_fp8(x, max_tile=max_tile)
    rq, rs = quantize_rows_fp8_ref(x)
    assert q.dtype == FP8 and s.shape == (6, 1) and s.dtype == torch.float32
    assert torch.equal(q.float(), rq.float()) and torch.equal(s, rs)  # (+0.0 may stand for torch's -0.0)
    x[5, :3] = torch.tensor([-1e-9, 1e-9, 0.0], dtype=dtype)  # values rounding to zero, either sign
    q, s = quantize_rows_fp8(x, max_tile=max_tile)
    assert float(q[5, :3].float().abs().max()) == 0.0 and torch.equal(q.float(), quantize_rows_fp8_ref(x)[0].float())
    assert s[2, 0] == 1.0 and float(q[2].float().abs().max()) == 0.0
    e, es = quantize_rows_fp8(x[:0])
    assert e.shape == (0, 300) and es.shape == (0, 1)


def test_w8a8_reference_equals_torch_scaled_mm():
    """The reference of the W8A8 path computes what torch._scaled_mm's row-wise scaling computes
    (torch's CPU kernel, same codes and scales): the kernel the GPU path calls, checked for meaning."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    q, s = quantize_fp8(torch.randn(48, 64, generator=g) * 0.1)
    ref = fp8_scaled_mm_ref(x, q, s)
    xq, sx = quantize_rows_fp8_ref(x)
    got = torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=s.view(1, -1), out_dtype=torch.bfloat16)
    assert torch.allclose(ref.float(), got.float(), rtol=1e-2, atol=1e-3)
    # and W8A8 stays near the weight-only product (activation codes: ~2**-5 relative each)
    wo = w8_linear_ref(x.float(), q, s)
    assert (ref.float() - wo).abs().max() <= 0.08 * wo.abs().max()


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_over_e4m3_codes_matches_reference(m, dtype):
    w, g = _w(37, 300, m)
    q, s = quantize_fp8(w)
    x = torch.randn(m, 300, generator=g).to(dtype)
    out = torch.full((m, 37), float("nan"), dtype=dtype)
    y = gemv(x, q, 8, 4, 64, 2, 4, out=out, scale=s)
    ref = w8_linear_ref(x, q, s)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert y is out and torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * float(s.max()) * 300 ** 0.5)


@pytest.mark.parametrize("m,cfg", [(5, (16, 16, 32, 1, 4, 1)), (40, (32, 32, 64, 2, 4, 2)), (17, (16, 32, 32, 2, 4, 1, 3))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_w8_gemm_over_e4m3_codes_matches_reference(m, cfg, dtype):
    w, g = _w(70, 200, m)
    q, s = quantize_fp8(w)
    x = torch.randn(m, 200, generator=g).to(dtype)
    b = torch.randn(70, generator=g).to(dtype)
    out = torch.full((m, 70), float("nan"), dtype=dtype)
    y = w8_gemm(x, q, s, b, config=cfg, out=out)
    ref = w8_linear_ref(x, q, s, b)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert y is out and torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * float(s.max()) * 200 ** 0.5)


@pytest.mark.parametrize("cfg", [(16, 16, 32, 1, 4, 1), (32, 16, 64, 3, 4, 2), (16, 32, 32, 2, 4, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_mm_matches_w8a8_reference(cfg, dtype):
    """The Triton W8A8 kernel (activation codes per row, e4m3 x e4m3 dots, both scales in the
    epilogue; split K summed by the caller) against the reference, ragged M / N / K, with a bias."""
    w, g = _w(70, 200, cfg[0] + cfg[3])
    q, s = quantize_fp8(w)
    x = torch.randn(9, 200, generator=g).to(dtype)
    x[4] = 0.0  # a zero row: scale 1
    b = torch.randn(70, generator=g).to(dtype)
    y = fp8_mm(x, q, s, b, config=cfg)
    ref = fp8_scaled_mm_ref(x, q, s, b)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert y.dtype == dtype and torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * float(ref.abs().max()))
    assert fp8_mm(x[:0], q, s).shape == (0, 70)


def _codes_equal(q, s, ref_q, ref_s):
    # codes compared by value: the kernels may write +0.0 where torch writes -0.0
    return q.dtype == FP8 and torch.equal(q.float(), ref_q.float()) and torch.equal(s, ref_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("variant", ["plain", "residual", "pre_scale", "unit_offset"])
def test_rms_norm_with_fp8_codes_equals_quantizer_over_its_output(dtype, variant):
    """scale_out: the norm's launch writes quantize_rows_fp8's codes and scales of the very output it
    writes without it (same arithmetic up to the rounding, then the quantizer's), for every form of
    the norm the decoder layers use; the new residual is unchanged."""
    g = torch.Generator().manual_seed(11)
    t, h = 7, 200
    x = (torch.randn(t, h, generator=g) * torch.logspace(-3, 1, t)[:, None]).to(dtype)
    x[3] = 0.0
    w = (torch.rand(h, generator=g) + 0.5).to(dtype)
    kw = {}
    if variant != "plain":
        kw["residual"] = torch.randn(t, h, generator=g).to(dtype)
    if variant == "pre_scale":
        kw.update(pre_weight=(torch.rand(h, generator=g) + 0.5).to(dtype), x_scale=0.22)
    if variant == "unit_offset":
        kw["unit_offset"] = True
    plain = rms_norm(x, w, 1e-6, **kw)
    s = torch.full((t, 1), float("nan"))
    quant = rms_norm(x, w, 1e-6, scale_out=s, **kw)
    y, q = (plain, quant) if variant == "plain" else (plain[0], quant[0])
    assert _codes_equal(q, s, *quantize_rows_fp8_ref(y))
    if variant != "plain":
        assert torch.equal(quant[1], plain[1])
    with pytest.raises(ValueError, match="scale_out must be float32"):
        rms_norm(x, w, 1e-6, scale_out=torch.empty(t, 2), **kw)
    with pytest.raises(ValueError, match="output in x's dtype"):  # float32 weight over 16-bit x: a float32 output
        rms_norm(x.half(), w.float(), 1e-6, scale_out=torch.empty(t, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", [silu_and_mul, gelu_tanh_and_mul])
@pytest.mark.parametrize("one_pass", [True, False])
def test_act_and_mul_with_fp8_codes_equals_quantizer_over_its_output(dtype, act, one_pass, monkeypatch):
    """scale_out: the activation's launch (a program per row; a row longer than a tile computed
    twice) writes quantize_rows_fp8's codes and scales of what it writes without it."""
    import pageflash.kernels.activation as A

    if not one_pass:
        orig = A.rows_config
        monkeypatch.setattr(A, "rows_config", lambda k: orig(k, 128))  # 300 columns: three tiles of 128
    g = torch.Generator().manual_seed(12)
    x = (torch.randn(5, 640, generator=g) * 3).to(dtype)[:, 20:620]  # strided rows
    x[1] = 0.0
    s = torch.full((5, 1), float("nan"))
    q = act(x, scale_out=s)
    assert q.shape == (5, 300) and _codes_equal(q, s, *quantize_rows_fp8_ref(act(x)))
    assert s[1, 0] == 1.0
    with pytest.raises(ValueError, match="out must be"):
        act(x, out=torch.empty(5, 300, dtype=dtype), scale_out=s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_mm_over_fp8_rows_equals_quantizing_itself(dtype):
    """An Fp8Rows (x's rows quantized by the launch that made x) gives fp8_mm exactly what it
    computes from x; a malformed one is refused by name."""
    w, g = _w(70, 200, 5)
    q, s = quantize_fp8(w)
    x = torch.randn(9, 200, generator=g).to(dtype)
    b = torch.randn(70, generator=g).to(dtype)
    cfg = (16, 16, 32, 2, 4, 1)
    rows = Fp8Rows(*quantize_rows_fp8(x), dtype)
    assert rows.shape == (9, 200) and rows.device == x.device
    y = fp8_mm(rows, q, s, b, config=cfg)
    assert y.dtype == dtype and torch.equal(y, fp8_mm(x, q, s, b, config=cfg))
    with pytest.raises(ValueError, match="Fp8Rows needs"):
        fp8_mm(Fp8Rows(rows.codes, rows.scale.view(-1), dtype), q, s)
    with pytest.raises(ValueError, match="expected x"):
        fp8_mm(Fp8Rows(rows.codes[:, :100], rows.scale, dtype), q, s)


def test_linear_takes_fp8_rows_only_where_it_would_quantize_them(monkeypatch):
    """Linear.takes_fp8_rows: only an "fp8" layer without LoRA, on CUDA, from PAGEFLASH_FP8_MM_M rows on
    (the decision itself is fp8_linear's, checked on the GPU: tests/gpu/test_fp8_gpu.py)."""
    import pageflash.kernels.fp8_linear as F8
    from pageflash.layers.linear import Linear

    lin = Linear(64, 32)
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(8, 64).to(torch.bfloat16)
    assert not lin.takes_fp8_rows(x)  # not quantized
    lin.quantize_("fp8")
    assert not lin.takes_fp8_rows(x)  # CPU
    monkeypatch.setattr(F8, "_fp8_tensor_cores", lambda device: True)

    class _Cuda:  # the activations' shape, dtype and device, as the layers ask it
        shape, dtype, device = (8, 64), torch.bfloat16, torch.device("cuda", 0)

    assert lin.takes_fp8_rows(_Cuda())
    monkeypatch.setenv("PAGEFLASH_FP8_FUSED_QUANT", "0")
    assert not lin.takes_fp8_rows(_Cuda())
    monkeypatch.delenv("PAGEFLASH_FP8_FUSED_QUANT")
    _Cuda.shape = (2, 64)  # below PAGEFLASH_FP8_MM_M: the weight-only GEMV, which reads x itself
    assert not lin.takes_fp8_rows(_Cuda())
    _Cuda.shape, _Cuda.dtype = (8, 64), torch.float16  # fp16 activations: weight-only
    assert not lin.takes_fp8_rows(_Cuda())
    _Cuda.dtype = torch.bfloat16
    lin.lora = torch.nn.Identity()  # LoRA's shrink reads x
    assert not lin.takes_fp8_rows(_Cuda())
    lin.lora = None
    assert lin.takes_fp8_rows(_Cuda())
    int8 = Linear(64, 32)
    int8.quantize_("int8")
    assert not int8.takes_fp8_rows(_Cuda())


def test_dispatch_settings_that_are_no_count_are_named(monkeypatch):
    """A row-count setting of the 8-bit dispatch that is no count is an error naming the variable."""
    from pageflash.kernels.w8_linear import _dequant_min_m

    q, s = quantize_fp8(torch.randn(16, 32))
    monkeypatch.setenv("PAGEFLASH_FP8_MM_M", "3.5")
    with pytest.raises(ValueError, match="PAGEFLASH_FP8_MM_M must be an integer"):
        fp8_linear(torch.randn(4, 32), q, s)
    monkeypatch.setenv("PAGEFLASH_W8_DEQUANT_M", "lots")
    with pytest.raises(ValueError, match="PAGEFLASH_W8_DEQUANT_M must be an integer"):
        _dequant_min_m()


def test_fp8_linear_on_cpu_is_the_dequantized_weight_and_w8a8_refuses_cpu():
    w, g = _w(48, 64, 8)
    q, s = quantize_fp8(w)
    x = torch.randn(40, 64, generator=g)
    b = torch.randn(48, generator=g)
    want = torch.nn.functional.linear(x, dequantize_int8(q, s, torch.float32), b)
    assert torch.equal(fp8_linear(x, q, s, b), want)
    assert fp8_linear(x, q, s, float_out=True).dtype == torch.float32
    assert not scaled_mm_applies(x.bfloat16(), q)
    with pytest.raises(ValueError, match="needs CUDA"):
        fp8_scaled_mm(x.bfloat16(), q, s)
    with pytest.raises(ValueError, match="float8_e4m3fn q"):
        fp8_scaled_mm_ref(x, q.float(), s)
    with pytest.raises(ValueError, match="bias"):
        fp8_scaled_mm_ref(x, q, s, torch.zeros(3))


def test_fp8_is_named_in_quantization_errors():
    with pytest.raises(ValueError, match=r"quantization must be None or one of \['int8', 'fp8'\], got 'fp4'"):
        LLM("smollm2-135m", quantization="fp4")
    from pageflash.layers.linear import Linear

    lin = Linear(16, 8)
    lin.weight.data.normal_()
    lin.quantize_("fp8")
    assert lin.weight.dtype == FP8
    with pytest.raises(ValueError, match="already quantized"):
        lin.quantize_("int8")
    x = torch.randn(3, 16)
    assert torch.allclose(lin(x), w8_linear_ref(x, lin.weight, lin.weight_scale), rtol=1e-5, atol=1e-5)
