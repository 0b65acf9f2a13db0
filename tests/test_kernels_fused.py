"""Fused elementwise kernels (rms_norm, apply_rotary, silu_and_mul) under the Triton interpreter,
against the PyTorch references; the layers' dispatch to them.

fp32 and fp16 only: bf16 arithmetic is wrong under the interpreter (tests/gpu covers bf16).
"""

from __future__ import annotations

import pytest
import torch

from kernel_checks import poison_outputs  # noqa: F401  (autouse: outputs start poisoned)

from pageflash.config import ModelConfig
from pageflash.kernels.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_ref, silu_and_mul, silu_and_mul_ref
from pageflash.kernels.rms_norm import qk_rms_norm_, qk_rms_norm_ref, rms_norm, rms_norm_fused_ref, rms_norm_ref
from pageflash.kernels.rotary import apply_rotary, apply_rotary_ref
from pageflash.layers import activation as activation_layer
from pageflash.layers import norm as norm_layer
from pageflash.layers import rotary as rotary_layer

TOL = {torch.float32: 2e-6, torch.float16: 1e-3}
DTYPES = [torch.float32, torch.float16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert not torch.isnan(a).any(), "NaN in output (unwritten or poisoned elements)"
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def rnd(*shape, dtype, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ---------------------------------------------------------------------------------------- rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 64), (5, 100), (3, 257)])
def test_rms_norm(t, h, dtype):
    g = torch.Generator().manual_seed(t * h)
    x, w = rnd(t, h, dtype=dtype, g=g, scale=3.0), rnd(h, dtype=dtype, g=g)
    out = rms_norm(x, w, 1e-5)
    assert rel_err(out, rms_norm_ref(x, w, 1e-5)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 64), (6, 200)])
def test_rms_norm_residual(t, h, dtype):
    g = torch.Generator().manual_seed(t + h)
    x, r, w = rnd(t, h, dtype=dtype, g=g), rnd(t, h, dtype=dtype, g=g, scale=4.0), rnd(h, dtype=dtype, g=g)
    x0, r0 = x.clone(), r.clone()
    out, new_r = rms_norm(x, w, 1e-6, r)
    ref, ref_r = rms_norm_fused_ref(x0, w, 1e-6, r0)
    assert torch.equal(new_r, ref_r)  # the add rounds exactly as PyTorch's does
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(x, x0) and torch.equal(r, r0)  # inputs untouched by default


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", [(1, 64), (6, 200)])
def test_rms_norm_unit_offset(t, h, dtype):
    """Gemma's norm: times (1 + weight) in float32, one rounding; with and without the residual add;
    it differs from the Llama form (so the flag is not a no-op)."""
    g = torch.Generator().manual_seed(t * 7 + h)
    x, r, w = rnd(t, h, dtype=dtype, g=g, scale=3.0), rnd(t, h, dtype=dtype, g=g), rnd(h, dtype=dtype, g=g)
    ref = rms_norm_ref(x, w, 1e-6, unit_offset=True)
    xf = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.equal(ref, (xf * (1 + w.float())).to(dtype))  # the reference is transformers' GemmaRMSNorm
    out = rms_norm(x, w, 1e-6, unit_offset=True)
    assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype]
    assert rel_err(out, rms_norm_ref(x, w, 1e-6)) > 0.1
    out, new_r = rms_norm(x, w, 1e-6, r, unit_offset=True)
    ref, ref_r = rms_norm_fused_ref(x, w, 1e-6, r, unit_offset=True)
    assert torch.equal(new_r, ref_r) and rel_err(out, ref) < TOL[dtype]
    # sandwich norms: x normed with pre_weight, added to the residual, normed again, in one launch
    pw = rnd(h, dtype=dtype, g=g)
    out, new_r = rms_norm(x, w, 1e-6, r, unit_offset=True, pre_weight=pw)
    ref, ref_r = rms_norm_fused_ref(x, w, 1e-6, r, unit_offset=True, pre_weight=pw)
    y = rms_norm_ref(x, pw, 1e-6, unit_offset=True)
    assert torch.equal(ref_r, y + r)  # the reference is the two norms and the add, one after another
    assert rel_err(new_r, ref_r) < TOL[dtype] and rel_err(out, ref) < TOL[dtype]
    with pytest.raises(ValueError, match="pre_weight needs a residual"):
        rms_norm(x, w, 1e-6, unit_offset=True, pre_weight=pw)
    # Granite's residual_multiplier: x * 0.22 (rounded to x's dtype) is what is added
    out, new_r = rms_norm(x, w, 1e-6, r, x_scale=0.22)
    ref, ref_r = rms_norm_fused_ref(x, w, 1e-6, r, x_scale=0.22)
    assert torch.equal(ref_r, x * 0.22 + r) and torch.equal(new_r, ref_r) and rel_err(out, ref) < TOL[dtype]
    with pytest.raises(ValueError, match="x_scale needs a residual"):
        rms_norm(x, w, 1e-6, x_scale=0.5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_in_place_and_strided_rows(dtype):
    """x as a strided slice of a wider buffer; residual updated in place; out written over x."""
    g = torch.Generator().manual_seed(7)
    t, h = 4, 96
    buf = rnd(t, 2 * h, dtype=dtype, g=g)
    x = buf[:, h:]  # row stride 2h
    r, w = rnd(t, h, dtype=dtype, g=g), rnd(h, dtype=dtype, g=g)
    ref, ref_r = rms_norm_fused_ref(x.clone(), w, 1e-5, r.clone())
    untouched = buf[:, :h].clone()
    out, new_r = rms_norm(x, w, 1e-5, r, residual_out=r, out=x)
    assert new_r is r and out is x
    assert torch.equal(r, ref_r)
    assert rel_err(x, ref) < TOL[dtype]
    assert torch.equal(buf[:, :h], untouched)


def test_rms_norm_residual_out_over_x():
    g = torch.Generator().manual_seed(8)
    x, r, w = rnd(3, 64, dtype=torch.float32, g=g), rnd(3, 64, dtype=torch.float32, g=g), rnd(64, dtype=torch.float32, g=g)
    ref, ref_r = rms_norm_fused_ref(x.clone(), w, 1e-5, r.clone())
    out, new_r = rms_norm(x, w, 1e-5, r, residual_out=x)
    assert new_r is x and torch.equal(x, ref_r) and rel_err(out, ref) < TOL[torch.float32]


def test_rms_norm_fp32_weight_promotes():
    """An fp16 x with an fp32 weight gives fp32, as `weight * xn.to(fp16)` does in PyTorch."""
    g = torch.Generator().manual_seed(9)
    x, w = rnd(3, 80, dtype=torch.float16, g=g), rnd(80, dtype=torch.float32, g=g)
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == torch.float32 and rel_err(out, rms_norm_ref(x, w, 1e-5)) < TOL[torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 4, 2, 16), (5, 8, 1, 32), (3, 2, 2, 24)])
def test_qk_rms_norm_in_place(t, hq, hkv, d, dtype):
    """Qwen3's per-head q / k norm in the QKV output, in place: q heads with q_weight, k heads with
    k_weight, v untouched (bitwise), over strided rows too."""
    g = torch.Generator().manual_seed(t * 100 + d)
    width = (hq + 2 * hkv) * d
    buf = rnd(t, width + 7, dtype=dtype, g=g, scale=3.0)  # rows strided: a wider buffer's first columns
    qkv = buf[:, :width]
    qw, kw = rnd(d, dtype=dtype, g=g, scale=0.3) + 1, rnd(d, dtype=dtype, g=g, scale=0.3) + 1
    ref = qk_rms_norm_ref(qkv.clone(), qw, kw, 1e-6, hq, hkv, d)
    tail = buf[:, width:].clone()
    out = qk_rms_norm_(qkv, qw, kw, 1e-6, hq, hkv, d)
    assert out.data_ptr() == qkv.data_ptr()
    assert rel_err(qkv, ref) < TOL[dtype]
    assert torch.equal(qkv[:, (hq + hkv) * d:], ref[:, (hq + hkv) * d:]) and torch.equal(buf[:, width:], tail)
    qkv2 = buf[:, :width].clone()
    ref2 = qk_rms_norm_ref(qkv2.clone(), qw - 1, kw - 1, 1e-6, hq, hkv, d, unit_offset=True)  # Gemma 3's
    qk_rms_norm_(qkv2, qw - 1, kw - 1, 1e-6, hq, hkv, d, unit_offset=True)
    assert rel_err(qkv2, ref2) < TOL[dtype]
    with pytest.raises(ValueError, match="qkv must be"):
        qk_rms_norm_(qkv[:, :-1], qw, kw, 1e-6, hq, hkv, d)
    with pytest.raises(ValueError, match="k_weight"):
        qk_rms_norm_(qkv, qw, kw[:-1], 1e-6, hq, hkv, d)


def test_rms_norm_empty_and_bad_inputs():
    w = torch.ones(8)
    assert rms_norm(torch.zeros(0, 8), w, 1e-5).shape == (0, 8)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(2, 8), torch.ones(9), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(torch.zeros(2, 8), w, 1e-5, torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous in H"):
        rms_norm(torch.zeros(8, 2).t(), torch.ones(8), 1e-5)
    with pytest.raises(TypeError, match="dtype"):
        rms_norm(torch.zeros(2, 8, dtype=torch.float64), w, 1e-5)
    r = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="different"):
        rms_norm(torch.zeros(2, 8), w, 1e-5, r, out=r, residual_out=r)


# ------------------------------------------------------------------------------------------ rotary


def _qkv_views(t, hq, hkv, d, dtype, g):
    """q, k, v as views of one fused qkv projection output [T, (Hq + 2 Hkv) * D]."""
    qkv = rnd(t, (hq + 2 * hkv) * d, dtype=dtype, g=g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return qkv, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


# rot < d: partial rotary embeddings (Phi-4-mini: 96 of 128), the tables scaled as YaRN / LongRoPE scale them
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d,rot", [(1, 4, 1, 64, 64), (9, 3, 3, 80, 80), (20, 6, 2, 32, 32),
                                            (7, 4, 2, 32, 24), (3, 2, 1, 80, 40)])
def test_rotary_fused_qkv_views(t, hq, hkv, d, rot, dtype):
    g = torch.Generator().manual_seed(t * hq + d)
    _, q, k, v = _qkv_views(t, hq, hkv, d, dtype, g)
    assert t == 1 or q.stride(0) == k.stride(0) == (hq + 2 * hkv) * d  # rows wider than Hq * D
    npos = 64
    pos = torch.randint(0, npos, (t,), generator=g)
    ang = torch.outer(torch.arange(npos, dtype=torch.float32), torch.rand(rot // 2, generator=g))
    scale = 1.0 if rot == d else 1.2
    cos, sin = ang.cos() * scale, ang.sin() * scale
    v0, q0 = v.clone(), q.clone()
    ref_q, ref_k = apply_rotary_ref(q, k, pos, cos, sin)
    rq, rk = apply_rotary(q, k, pos, cos, sin)
    assert rq is q and rk is k
    # same operations in the same order, each rounded as PyTorch rounds it: bitwise equal
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(v, v0) and torch.equal(q[..., rot:], q0[..., rot:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d,bs,rot", [(1, 4, 1, 64, 16, 64), (9, 3, 3, 80, 4, 80), (20, 6, 2, 32, 8, 32),
                                               (9, 3, 3, 80, 4, 48), (20, 6, 2, 32, 8, 24)])
def test_rotary_with_cache_store_equals_rotary_then_store(t, hq, hkv, d, bs, rot, dtype):
    """The fused rotary + K/V store writes exactly what rotary then store_kv_ref write: the rotated
    k (its dims past rot as they were), the unchanged v, at shuffled slots with some -1 (skipped);
    nothing else in the cache moves."""
    from pageflash.layers.attention import store_kv_ref

    g = torch.Generator().manual_seed(t * 7 + d + bs)
    _, q, k, v = _qkv_views(t, hq, hkv, d, dtype, g)
    npos, nblocks = 64, 8
    pos = torch.randint(0, npos, (t,), generator=g)
    ang = torch.outer(torch.arange(npos, dtype=torch.float32), torch.rand(rot // 2, generator=g))
    cos, sin = ang.cos(), ang.sin()
    slots = torch.randperm(nblocks * bs, generator=g)[:t]
    slots[::3] = -1
    kc, vc = rnd(nblocks, bs, hkv, d, dtype=dtype, g=g), rnd(nblocks, bs, hkv, d, dtype=dtype, g=g)
    ref_kc, ref_vc = kc.clone(), vc.clone()
    ref_q, ref_k = apply_rotary_ref(q, k, pos, cos, sin)
    store_kv_ref(ref_k, v, ref_kc, ref_vc, slots)
    apply_rotary(q, k, pos, cos, sin, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    with pytest.raises(ValueError, match="go together"):
        apply_rotary(q, k, pos, cos, sin, v=v, k_cache=kc)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_scaled_tables(dtype):
    """RotaryEmbedding's tables of YaRN (times its attention factor) and of a Phi-4-mini-like LongRoPE
    with partial rotary (short and long rows, by rows()): the kernel equals the reference bit for bit."""
    base = dict(vocab_size=32, hidden_size=128, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=64)
    cfgs = [ModelConfig(**base, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
            ModelConfig(**base, architecture="Phi3ForCausalLM", partial_rotary_factor=0.75,
                        rope_scaling=dict(rope_type="longrope", original_max_position_embeddings=16,
                                          short_factor=[1.0] * 12, long_factor=[1.0 + i for i in range(12)]))]
    g = torch.Generator().manual_seed(4)
    for cfg in cfgs:
        rope = rotary_layer.RotaryEmbedding(cfg, max_positions=64)
        assert rope.cos.abs().max() > 1.0  # the attention factor is in the tables
        _, q, k, _ = _qkv_views(9, 4, 2, cfg.head_dim, dtype, g)
        rows = rope.rows(torch.randint(0, 64, (9,), generator=g))
        ref_q, ref_k = apply_rotary_ref(q, k, rows, rope.cos, rope.sin)
        apply_rotary(q, k, rows, rope.cos, rope.sin)
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


def test_rotary_int32_positions_and_strided_tables():
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d = 5, 2, 1, 16
    _, q, k, _ = _qkv_views(t, hq, hkv, d, torch.float32, g)
    table = torch.randn(32, d, generator=g)  # cos/sin as column halves of one table: row stride d
    cos, sin = table[:, : d // 2], table[:, d // 2:]
    pos = torch.randint(0, 32, (t,), generator=g)
    ref_q, ref_k = apply_rotary_ref(q, k, pos, cos, sin)
    apply_rotary(q, k, pos.int(), cos, sin)
    assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


def test_rotary_bad_inputs():
    q, k = torch.zeros(2, 2, 8), torch.zeros(2, 1, 8)
    cos = torch.zeros(4, 4)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary(q, k, torch.zeros(3, dtype=torch.int64), cos, cos)
    with pytest.raises(ValueError, match=r"cos must be float32 \[P, R/2\] with R <= head_dim \(8\)"):
        apply_rotary(q, k, torch.zeros(2, dtype=torch.int64), torch.zeros(4, 5), cos)
    with pytest.raises(ValueError, match="differ in width"):  # (3 columns: partial rotary, both tables)
        apply_rotary(q, k, torch.zeros(2, dtype=torch.int64), torch.zeros(4, 3), cos)
    with pytest.raises(TypeError, match="dtype"):
        apply_rotary(q, k.half(), torch.zeros(2, dtype=torch.int64), cos, cos)


# ------------------------------------------------------------------------------------ silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 64), (3, 300), (20, 130)])
def test_silu_and_mul(t, i, dtype):
    g = torch.Generator().manual_seed(t * i)
    x = rnd(t, 2 * i, dtype=dtype, g=g, scale=4.0)
    # not bitwise on the CPU: numpy's exp and ATen's CPU silu round differently (CUDA: see tests/gpu)
    assert rel_err(silu_and_mul(x), silu_and_mul_ref(x)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", [(1, 64), (20, 130)])
def test_gelu_tanh_and_mul(t, i, dtype):
    """Gemma's GeGLU: torch's gelu(approximate="tanh") of the gate times up (the interpreter's tanh
    goes through exp; CUDA's through libdevice, tests/gpu)."""
    g = torch.Generator().manual_seed(t * i + 1)
    x = rnd(t, 2 * i, dtype=dtype, g=g, scale=4.0)
    x[0, :4] = torch.tensor([-30.0, 30.0, 0.0, -3.0])  # tanh's saturated ends
    assert rel_err(gelu_tanh_and_mul(x), gelu_tanh_and_mul_ref(x)) < TOL[dtype]
    assert rel_err(gelu_tanh_and_mul(x), silu_and_mul_ref(x)) > 0.01


def test_silu_and_mul_strided_rows_and_out():
    g = torch.Generator().manual_seed(5)
    buf = rnd(4, 3 * 48, dtype=torch.float16, g=g)
    x = buf[:, 48:]  # [4, 96] with row stride 144
    out = torch.full((4, 48), float("nan"), dtype=torch.float16)
    assert silu_and_mul(x, out=out) is out
    assert rel_err(out, silu_and_mul_ref(x)) < TOL[torch.float16]
    with pytest.raises(ValueError, match=r"2\*I"):
        silu_and_mul(torch.zeros(2, 7))


# ---------------------------------------------------------------------------------- layer dispatch


@pytest.fixture
def fused_layers(monkeypatch):
    """Make the layers take their Triton path on CPU tensors (interpreter)."""
    monkeypatch.setattr(norm_layer, "_use_fused", lambda x, w: True)
    monkeypatch.setattr(rotary_layer, "_use_fused", lambda q, k: True)
    monkeypatch.setattr(activation_layer, "_use_fused", lambda x, act="silu": True)


def test_layers_dispatch_to_kernels(fused_layers):
    g = torch.Generator().manual_seed(11)
    dtype = torch.float16
    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    norm = norm_layer.RMSNorm(64, 1e-5).to(dtype)
    norm.weight.data.copy_(rnd(64, dtype=dtype, g=g))
    x, r = rnd(5, 64, dtype=dtype, g=g), rnd(5, 64, dtype=dtype, g=g)
    x0, r0 = x.clone(), r.clone()
    h, new_r = norm(x, r)
    ref, ref_r = rms_norm_fused_ref(x0, norm.weight, 1e-5, r0)
    assert torch.equal(new_r, ref_r) and rel_err(h, ref) < TOL[dtype]
    assert torch.equal(x, x0) and torch.equal(r, r0)  # the layer never writes its inputs
    assert rel_err(norm(x), rms_norm_ref(x, norm.weight, 1e-5)) < TOL[dtype]

    rope = rotary_layer.RotaryEmbedding(cfg, max_positions=40)
    _, q, k, _ = _qkv_views(5, 4, 2, 16, dtype, g)
    pos = torch.randint(0, 40, (5,), generator=g)
    ref_q, ref_k = apply_rotary_ref(q, k, pos, rope.cos, rope.sin)
    rq, rk = rope(pos, q, k)
    assert torch.equal(rq, ref_q) and torch.equal(rk, ref_k)

    y = rnd(2, 3, 2 * 96, dtype=dtype, g=g)  # leading dims are flattened and restored
    out = activation_layer.silu_and_mul(y)
    assert out.shape == (2, 3, 96) and rel_err(out, silu_and_mul_ref(y)) < TOL[dtype]
    out = activation_layer.act_and_mul(y, "gelu_pytorch_tanh")
    assert out.shape == (2, 3, 96) and rel_err(out, gelu_tanh_and_mul_ref(y)) < TOL[dtype]

    gemma = norm_layer.RMSNorm(64, 1e-6, unit_offset=True).to(dtype)
    assert torch.equal(gemma.weight, torch.zeros(64, dtype=dtype))  # stored as offsets from 1
    gemma.weight.data.copy_(rnd(64, dtype=dtype, g=g))
    h, new_r = gemma(x, r)
    ref, ref_r = rms_norm_fused_ref(x0, gemma.weight, 1e-6, r0, unit_offset=True)
    assert torch.equal(new_r, ref_r) and rel_err(h, ref) < TOL[dtype]
    pre = norm_layer.RMSNorm(64, 1e-6, unit_offset=True).to(dtype)
    pre.weight.data.copy_(rnd(64, dtype=dtype, g=g))
    h, new_r = gemma(x, r, pre=pre)  # one launch
    ref, ref_r = rms_norm_fused_ref(x0, gemma.weight, 1e-6, r0, unit_offset=True, pre_weight=pre.weight)
    assert rel_err(new_r, ref_r) < TOL[dtype] and rel_err(h, ref) < TOL[dtype]
    other = norm_layer.RMSNorm(64, 1e-5, unit_offset=True).to(dtype)  # another eps: two launches, same result
    h, new_r = gemma(x, r, pre=other)
    ref, ref_r = rms_norm_fused_ref(rms_norm_ref(x0, other.weight, 1e-5, True), gemma.weight, 1e-6, r0, True)
    assert rel_err(new_r, ref_r) < TOL[dtype] and rel_err(h, ref) < TOL[dtype]


def test_layers_stay_on_pytorch_without_cuda():
    x = torch.randn(3, 8)
    assert not norm_layer._use_fused(x, torch.ones(8))
    assert not rotary_layer._use_fused(x.view(3, 2, 4), x.view(3, 2, 4))
    assert not activation_layer._use_fused(x)
