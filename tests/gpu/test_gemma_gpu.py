"""Gemma (and Granite's multipliers) on the GPU: the softcapped attention kernels (Gemma 2) at Gemma shapes (head_dim 256) in bf16
against the PyTorch reference, the (1 + w) RMSNorm and the GeGLU kernel in bf16 against theirs, and the
engine (Triton backend, CUDA graphs, n-gram verify graphs) against the reference backend in float32 for
Gemma 2 and Gemma 3 shapes (dummy weights)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pageflash.kernels.activation import gelu_tanh_and_mul, gelu_tanh_and_mul_ref
from pageflash.kernels.backend import TritonBackend
from pageflash.kernels.flash_attention import flash_attn_varlen_fwd, flash_attn_varlen_ref
from pageflash.kernels.paged_attention import paged_attention, paged_attention_ref
from pageflash.kernels.rms_norm import qk_rms_norm_, qk_rms_norm_ref, rms_norm, rms_norm_fused_ref, rms_norm_ref
from pageflash.layers.attention import TorchBackend
from pageflash.model.registry import NAMED_CONFIGS
from test_fused_gpu import ulp_report
from test_kernels_gpu import DEV, TOL, make_case, rel_err, rnd
from test_window_gpu import _run, positions

poisoned = pytest.mark.usefixtures("poison_outputs")
SCALE = 256 ** -0.5  # query_pre_attn_scalar 256


@poisoned
@pytest.mark.parametrize("cap", [2.0, 50.0])
@pytest.mark.parametrize("b,L,window", [(1, 8192, None), (1, 8192, 4096), (16, 4096, None), (64, 1024, 512),
                                        (7, 17, None)])
def test_decode_softcap(b, L, window, cap):
    """gemma-2-9b's heads (16 over 8, D 256): Flash-Decoding and its fused rotary + store launch."""
    from pageflash.kernels.rotary import apply_rotary_ref

    lens = [L] + [random.Random(i).randint(1, L) for i in range(b - 1)]
    q, k, v, kc, vc, meta = make_case([(n - 1, 1) for n in lens], 16, 8, 256, 16, seed=b)
    q = q * 4  # scores of a few units: the cap of 2 bites
    ref = TorchBackend().forward(q, k, v, kc.clone(), vc.clone(), meta, SCALE, window=window, softcap=cap)
    be = TritonBackend()
    plan = be.plan(meta)
    out = be.forward(q, k, v, kc.clone(), vc.clone(), plan, SCALE, window=window, softcap=cap)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    ang = torch.rand(L + 1, 128, device=DEV) * 6.0
    cos, sin = ang.cos(), ang.sin()
    pos = meta.seq_lens.long() - 1
    qr, kr = apply_rotary_ref(q, k, pos, cos, sin)
    ref_r = TorchBackend().forward(qr, kr, v, kc.clone(), vc.clone(), meta, SCALE, window=window, softcap=cap)
    out_r = be.forward(q.clone(), k.clone(), v, kc.clone(), vc.clone(), plan, SCALE, rope=(pos, cos, sin),
                       window=window, softcap=cap)
    assert rel_err(out_r, ref_r) < TOL[torch.bfloat16]


@poisoned
@pytest.mark.parametrize("cap", [2.0, 50.0])
@pytest.mark.parametrize("case,tree,splits", [("chunked", False, 1), ("spec", False, 16), ("spec", True, 16)])
def test_paged_softcap(case, tree, splits, cap):
    specs = {"chunked": [(5000, 512), (16, 16), (3, 1), (0, 700)], "spec": [(6000, 5), (17, 8), (900, 4)]}[case]
    q, k, v, kc, vc, meta = make_case(specs, 16, 8, 256, 16, tree=tree, seed=7)
    q = q * 4
    pos = positions(meta)
    TorchBackend().forward(q, k, v, kc, vc, meta, SCALE, positions=pos)  # stores the new K/V
    for window in (None, 1024):
        ref = paged_attention_ref(q, kc, vc, meta, SCALE, window=window, positions=pos, softcap=cap)
        out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, SCALE,
                              meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask, num_splits=splits,
                              window=window, positions=pos, softcap=cap)
        assert rel_err(out, ref) < TOL[torch.bfloat16]


@poisoned
@pytest.mark.parametrize("cap", [2.0, 50.0])
@pytest.mark.parametrize("window", [None, 4096])
def test_varlen_prefill_softcap(window, cap):
    lens = [4096, 1000, 17, 2500]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    q, k, v = rnd(sum(lens), 16, 256) * 4, rnd(sum(lens), 8, 256), rnd(sum(lens), 8, 256)
    o, lse = flash_attn_varlen_fwd(q, k, v, cu, max(lens), True, SCALE, window=window, softcap=cap)
    o_ref, lse_ref = flash_attn_varlen_ref(q, k, v, cu, True, SCALE, window=window, softcap=cap)
    assert rel_err(o, o_ref) < TOL[torch.bfloat16]
    assert torch.allclose(lse, lse_ref, atol=2e-2)


@poisoned
@pytest.mark.parametrize("t", [1, 16, 4096])
def test_gemma_norms_and_geglu_bf16(t):
    """(1 + w) RMSNorm (with the residual add; the per-head q/k form of Gemma 3) and GeGLU in bf16."""
    torch.manual_seed(t)
    h = 3584
    x, w, r = rnd(t, h) * 2, rnd(h) * 0.2, rnd(t, h) * 8
    out, ref = rms_norm(x, w, 1e-6, unit_offset=True), rms_norm_ref(x, w, 1e-6, unit_offset=True)
    frac, ulps = ulp_report(out, ref)
    print(f"gemma rms_norm T={t}: {frac:.2e} differ, max {ulps} ulp")
    assert rel_err(out, ref) < TOL[torch.bfloat16] and ulps <= 1 and frac < 1e-2
    out, new_r = rms_norm(x, w, 1e-6, r, unit_offset=True)
    ref, ref_r = rms_norm_fused_ref(x, w, 1e-6, r, unit_offset=True)
    assert torch.equal(new_r, ref_r) and rel_err(out, ref) < TOL[torch.bfloat16]
    # the sandwich norms' launch: norm(x, pw) + residual, normed; the sum as the two launches give it
    pw = rnd(h) * 0.2
    out, new_r = rms_norm(x, w, 1e-6, r, unit_offset=True, pre_weight=pw)
    y = rms_norm(x, pw, 1e-6, unit_offset=True)
    two, two_r = rms_norm(y, w, 1e-6, r, unit_offset=True)
    assert torch.equal(new_r, two_r) and torch.equal(out, two)
    ref, ref_r = rms_norm_fused_ref(x, w, 1e-6, r, unit_offset=True, pre_weight=pw)
    assert rel_err(out, ref) < TOL[torch.bfloat16] and rel_err(new_r, ref_r) < TOL[torch.bfloat16]
    # Granite's residual_multiplier in the add: bitwise x * 0.22 + residual (PyTorch's rounding)
    out, new_r = rms_norm(x, w + 1, 1e-5, r, x_scale=0.22)
    assert torch.equal(new_r, x * 0.22 + r) and rel_err(out, rms_norm_ref(x * 0.22 + r, w + 1, 1e-5)) < TOL[torch.bfloat16]
    qkv, qw, kw = rnd(t, (8 + 2 * 4) * 256) * 2, rnd(256) * 0.2, rnd(256) * 0.2
    ref = qk_rms_norm_ref(qkv, qw, kw, 1e-6, 8, 4, 256, unit_offset=True)
    qk_rms_norm_(qkv, qw, kw, 1e-6, 8, 4, 256, unit_offset=True)
    assert rel_err(qkv, ref) < TOL[torch.bfloat16]
    gu = rnd(t, 2 * 14336) * 3
    out, ref = gelu_tanh_and_mul(gu), gelu_tanh_and_mul_ref(gu)
    frac, ulps = ulp_report(out, ref)
    print(f"gelu_tanh_and_mul T={t}: {frac:.2e} differ, max {ulps} ulp")
    assert rel_err(out, ref) < TOL[torch.bfloat16] and ulps <= 1 and frac < 1e-2


# --------------------------------------------------------------------------------------------- engine

def _folder(tmp_path_factory, name, **over):
    d = tmp_path_factory.mktemp(name)
    (d / "config.json").write_text(json.dumps(dict(NAMED_CONFIGS[name], **over)))
    return str(d)


@pytest.mark.parametrize("name,over", [
    # 4 of gemma-2-9b's layers, windows of 64 (layers 0 and 2), a cap of 5 on the scores
    ("gemma-2-9b", dict(num_hidden_layers=4, sliding_window=64, attn_logit_softcapping=5.0)),
    # 6 of gemma-3-1b's layers: 5 slide over 64 tokens with the local rope, 1 attends to everything
    ("gemma-3-1b", dict(num_hidden_layers=6, sliding_window=64)),
    # 4 of granite-3.1-8b's layers (its multipliers)
    ("granite-3.1-8b", dict(num_hidden_layers=4)),
    # 2 of phi-4-mini's layers (96 of 128 dims rotate) with LongRoPE switching at 120 tokens: prompts
    # of 180 and 250 long throughout, the 100-token one recomputed when it crosses while decoding
    ("phi-4-mini", dict(num_hidden_layers=2, original_max_position_embeddings=120)),
])
def test_engine_triton_graphs_equal_torch_fp32(tmp_path_factory, name, over):
    folder = _folder(tmp_path_factory, name, **over)
    ref, _ = _run(folder, attention_backend="torch", enforce_eager=True)
    tri, llm = _run(folder)  # Triton, decode graphs, async scheduling
    assert llm.llm_engine.runner.graphs is not None
    assert tri == ref
    tree, llm = _run(folder, speculative_config=dict(method="ngram", tree=[2], num_speculative_tokens=6))
    assert tree == ref
