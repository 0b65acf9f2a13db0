"""Quantized KV cache (kv_cache_dtype "int8" / "fp8"): the codes and scales, every kernel that writes
or reads the cache against the PyTorch references (Triton interpreter on CPU), and the engine against
HF transformers whose attention reads K/V through the same quantization."""

from __future__ import annotations

import pytest
import torch

from hf_ref import hf_greedy, make_random_hf_folder
from pageflash import LLM, SamplingParams
from pageflash.kernels.flash_decoding import flash_decode, flash_decode_ref
from pageflash.kernels.kv_store import store_kv
from pageflash.kernels.paged_attention import paged_attention
from pageflash.kernels.rotary import apply_rotary, apply_rotary_ref
from pageflash.layers.attention import (
    TorchBackend, _decode_batched_ref, dequantize_kv_ref, get_backend, paged_attention_ref, quantize_kv_ref,
    store_kv_ref,
)
from test_kernels_paged import make_case, poison_outputs, rel_err  # noqa: F401  (poison_outputs: autouse)

CODES = [torch.int8, torch.float8_e4m3fn]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _quantized(kc: torch.Tensor, vc: torch.Tensor, code: torch.dtype, seed: int = 0):
    """A random float cache as codes + scales (each row quantized as the stores would)."""
    nb, page, h, d = kc.shape
    out = []
    for c in (kc, vc):
        codes, s = quantize_kv_ref(c, code)  # s: [nb, page, h]
        out += [codes, s.transpose(1, 2).contiguous()]
    kq, ks, vq, vs = out
    return kq, vq, (ks, vs)


# ---- the codes ------------------------------------------------------------------------------------

def test_quantize_kv_ref_bounds():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 32, generator=g) * torch.logspace(-3, 2, 64).view(64, 1, 1)
    x[5, 2] = 0.0  # a zero row: scale 0, codes 0, reads back 0
    codes, s = quantize_kv_ref(x, torch.int8)
    assert codes.dtype == torch.int8 and s.shape == (64, 4) and s.dtype == torch.float32
    assert codes.abs().max() == 127 and s[5, 2] == 0 and not codes[5, 2].any()
    err = (dequantize_kv_ref(codes, s) - x).abs()
    assert (err <= 0.5001 * s.unsqueeze(-1)).all()  # half a step
    f8, s8 = quantize_kv_ref(x, torch.float8_e4m3fn)
    y = dequantize_kv_ref(f8, s8)
    assert y.abs().amax(-1).sub(x.abs().amax(-1)).abs().max() <= 1e-4 * x.abs().max()  # the row max is exact
    # e4m3: 3 mantissa bits -> relative error <= 2**-4 for normals, <= 2**-10 x scale for subnormals
    assert ((y - x).abs() <= torch.maximum(x.abs() * 2**-4, s8.unsqueeze(-1) * 2**-10) * 1.0001).all()
    with pytest.raises(TypeError, match="no KV quantization"):
        quantize_kv_ref(x, torch.float16)


def test_e4m3_rounding_matches_torch():
    """The stores round to e4m3 themselves (the interpreter's own conversion does not carry a round-up
    into the exponent): every e4m3 value, the midpoints between neighbours (ties to even) and random
    values, with each row's maximum 448 so that the scale is 1, give torch's codes."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()  # sorted, -448 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    rnd = torch.randn(4000, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 2.3, 4000)
    vals = torch.cat([grid, mids, rnd.clamp(-448, 448)])
    d = 32
    rows = -(-vals.numel() // (d - 1))
    x = torch.zeros(rows * (d - 1))
    x[: vals.numel()] = vals
    x = torch.cat([x.view(rows, d - 1), torch.full((rows, 1), 448.0)], 1).view(rows, 1, d)
    kc = torch.zeros(rows, 1, 1, d, dtype=torch.float8_e4m3fn)
    ks = torch.zeros(rows, 1, 1)
    vc, vs = kc.clone(), ks.clone()
    store_kv(x, x, kc, vc, torch.arange(rows), (ks, vs))
    assert (ks == 1).all()
    assert torch.equal(_bytes(kc).view(rows, d), _bytes(x.view(rows, d).to(torch.float8_e4m3fn)))


# ---- the stores -----------------------------------------------------------------------------------

@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h,d,page", [(2, 64, 16), (3, 80, 8)])
def test_store_kv_quantized(code, dtype, h, d, page):
    g = torch.Generator().manual_seed(h * d)
    nblocks, t = 6, 9
    qkv = torch.randn(t, 2 + 2 * h, d, generator=g).to(dtype) * 3
    k, v = qkv[:, 2:2 + h], qkv[:, 2 + h:]  # strided rows, as views of a fused projection
    k[4, 1] = 0  # a zero row
    slots = torch.randperm(nblocks * page, generator=g)[:t]
    slots[[1, 5]] = -1
    kc = torch.randint(-100, 100, (nblocks, page, h, d), generator=g).to(torch.int8).view(code)
    vc = kc.clone()
    ks, vs = torch.rand(nblocks, h, page, generator=g), torch.rand(nblocks, h, page, generator=g)
    ref = [x.clone() for x in (kc, vc, ks, vs)]
    store_kv(k, v, kc, vc, slots, (ks, vs))
    store_kv_ref(k, v, ref[0], ref[1], slots, (ref[2], ref[3]))
    assert torch.equal(_bytes(kc), _bytes(ref[0])) and torch.equal(_bytes(vc), _bytes(ref[1]))
    assert torch.equal(ks, ref[2]) and torch.equal(vs, ref[3])


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("rot", [32, 24])
def test_rotary_fused_store_quantized(code, rot):
    """apply_rotary's fused store into a quantized cache == rotate (reference), then store_kv_ref; rot <
    32: partial rotary, the scale of a head taken over its rotated and its passed-through dims."""
    g = torch.Generator().manual_seed(3)
    t, hq, hkv, d, page, nb = 7, 4, 2, 32, 8, 4
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    k[:, :, rot:] *= 4  # (the largest entries outside the rotated dims: the scale must see them)
    pos = torch.randint(0, 50, (t,), generator=g)
    ang = torch.rand(64, rot // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    slots = torch.randperm(nb * page, generator=g)[:t]
    slots[2] = -1
    kc = torch.zeros(nb, page, hkv, d, dtype=code)
    vc = kc.clone()
    ks, vs = torch.zeros(nb, hkv, page), torch.zeros(nb, hkv, page)
    ref = [x.clone() for x in (kc, vc, ks, vs)]
    qr, kr = apply_rotary_ref(q, k, pos, cos, sin)
    store_kv_ref(kr, v, ref[0], ref[1], slots, (ref[2], ref[3]))
    apply_rotary(q, k, pos, cos, sin, v=v, k_cache=kc, v_cache=vc, slot_mapping=slots, kv_scales=(ks, vs))
    assert torch.equal(q, qr) and torch.equal(k, kr)
    assert torch.equal(_bytes(kc), _bytes(ref[0])) and torch.equal(_bytes(vc), _bytes(ref[1]))
    assert torch.equal(ks, ref[2]) and torch.equal(vs, ref[3])


# ---- the readers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,d,splits,fused", [((4, 1), 64, 1, False), ((8, 2), 32, 3, True),
                                                  ((6, 2), 80, 4, False)])
def test_flash_decode_quantized(code, dtype, heads, d, splits, fused):
    hq, hkv = heads
    specs = [(0, 1), (15, 1), (16, 1), (33, 1), (70, 1)]
    q, k, v, kc, vc, meta = make_case(specs, hq, hkv, d, 16, dtype, seed=splits)
    kq, vq, sc = _quantized(kc, vc, code)
    ref = flash_decode_ref(q, kq, vq, meta.block_tables, meta.seq_lens, d**-0.5, kv_scales=sc)
    counters = torch.zeros(len(specs) * hkv, dtype=torch.int32) if fused else None
    out = flash_decode(q, kq, vq, meta.block_tables, meta.seq_lens, d**-0.5, num_splits=splits,
                       counters=counters, kv_scales=sc)
    assert rel_err(out, ref) < TOL[dtype]
    # the reference really reads codes x scales: it differs from attention over the float cache
    plain = flash_decode_ref(q, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5)
    assert 1e-4 < rel_err(ref, plain) < 0.1


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("v_mag", [1e-3, 300.0])
@pytest.mark.parametrize("splits", [1, 3])
def test_flash_decode_quantized_fp16_tiny_and_large_values(code, v_mag, splits):
    """A float16 q: the codes widen to float16, and so do V's weights (softmax p x the key's scale). With
    values of V near 1e-3 (scales ~1e-5) those weights fall deep into float16's subnormals unless the
    kernel divides them by the tile's largest scale first (it does, and counts the output in units of
    it); values near 300 must not overflow either."""
    hq, hkv, d = 8, 2, 64
    specs = [(0, 1), (15, 1), (33, 1), (70, 1), (150, 1)]
    q, k, v, kc, vc, meta = make_case(specs, hq, hkv, d, 16, torch.float16, seed=7)
    kq, vq, sc = _quantized(kc, vc * v_mag, code)
    ref = flash_decode_ref(q, kq, vq, meta.block_tables, meta.seq_lens, d**-0.5, kv_scales=sc)
    assert ref.abs().max() > 0.05 * v_mag  # the outputs are of V's size, not zero
    out = flash_decode(q, kq, vq, meta.block_tables, meta.seq_lens, d**-0.5, num_splits=splits, kv_scales=sc)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits,fused,rot", [(1, False, 32), (3, True, 24), (5, False, 32)])
def test_flash_decode_rope_store_quantized(code, dtype, splits, fused, rot):
    """Rotary + store + decode in one launch on a quantized cache == apply_rotary's fused store, then
    flash_decode: the same codes and scales bit for bit; the new key, attended from registers, reads as
    its code x scale like every other key; a padded slot gives zeros and stores nothing. rot < 32:
    partial rotary. float16: the codes and V's weights through float16 (the new key's value first)."""
    hq, hkv, d = 8, 2, 32
    specs = [(0, 1), (15, 1), (16, 1), (33, 1), (70, 1)]
    q, k, v, kc, vc, meta = make_case(specs, hq, hkv, d, 16, dtype, seed=splits + 20)
    kq, vq, (ks, vs) = _quantized(kc, vc, code)
    g = torch.Generator().manual_seed(splits)
    ang = torch.rand(80, rot // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    pos = (meta.seq_lens - 1).to(torch.int64)
    sl, slots = meta.seq_lens.clone(), meta.slot_mapping.clone()
    sl[3], slots[3], pos[3] = 0, -1, 0
    ref_c = [x.clone() for x in (kq, vq, ks, vs)]
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary(q_ref, k_ref, pos, cos, sin, v=v, k_cache=ref_c[0], v_cache=ref_c[1], slot_mapping=slots,
                 kv_scales=(ref_c[2], ref_c[3]))
    ref = flash_decode_ref(q_ref, ref_c[0], ref_c[1], meta.block_tables, sl, d**-0.5, kv_scales=(ref_c[2], ref_c[3]))
    ref[3] = 0
    counters = torch.zeros(len(specs) * hkv, dtype=torch.int32) if fused else None
    out = flash_decode(q, kq, vq, meta.block_tables, sl, d**-0.5, num_splits=splits, counters=counters,
                       rope=(pos, cos, sin), k_new=k, v_new=v, slot_mapping=slots, kv_scales=(ks, vs))
    assert torch.equal(_bytes(kq), _bytes(ref_c[0])) and torch.equal(_bytes(vq), _bytes(ref_c[1]))
    assert torch.equal(ks, ref_c[2]) and torch.equal(vs, ref_c[3])
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("specs,tree,splits", [
    ([(0, 1), (0, 15), (0, 17), (0, 40)], False, 1),
    ([(33, 9), (16, 16), (5, 1), (47, 20)], False, 1),
    ([(30, 4), (1, 3), (64, 5)], True, 1),
    ([(70, 4), (1, 3), (33, 6), (0, 2)], True, 3),
])
def test_paged_attention_quantized(code, dtype, specs, tree, splits):
    q, k, v, kc, vc, meta = make_case(specs, 8, 2, 64, 8, dtype, tree=tree, seed=len(specs) + splits)
    kq, vq, sc = _quantized(kc, vc, code)
    ref = paged_attention_ref(q, kq, vq, meta, 0.125, sc)
    out = paged_attention(q, kq, vq, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125,
                          meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask, num_splits=splits,
                          config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1), kv_scales=sc)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("v_mag", [1e-3, 300.0])
@pytest.mark.parametrize("tree,splits", [(False, 1), (True, 3)])
def test_paged_attention_quantized_fp16_tiny_and_large_values(code, v_mag, tree, splits):
    """The paged kernel's float16 path over codes (as flash_decode's): V near 1e-3 keeps its precision
    (weights scaled by each tile's largest scale, the accumulator in its units across the kernel's
    masked / unmasked key ranges), V near 300 does not overflow."""
    specs = [(40, 9), (70, 4), (5, 20)]
    q, k, v, kc, vc, meta = make_case(specs, 8, 2, 64, 16, torch.float16, tree=tree, seed=11)
    kq, vq, sc = _quantized(kc, vc * v_mag, code)
    ref = paged_attention_ref(q, kq, vq, meta, 0.125, sc)
    assert ref.abs().max() > 0.05 * v_mag
    out = paged_attention(q, kq, vq, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125,
                          meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask, num_splits=splits,
                          config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1), kv_scales=sc)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[torch.float16]


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("specs,tree", [
    ([(0, 1), (16, 1), (30, 1)], False),  # decode-only: Flash-Decoding
    ([(0, 9), (0, 1), (0, 20)], False),  # fresh prefill: exact k and v
    ([(0, 9), (17, 1), (3, 16)], False),  # mixed
    ([(300, 4), (20, 3)], True),  # tree verify, keys split
    ([(16, 1), (40, 1), (5, 30), (3, 1)], False),  # the leading decodes via Flash-Decoding
])
def test_backend_vs_torch_quantized(code, specs, tree):
    """Both backends store the same codes and scales and attend alike; a fresh prefill attends over
    the exact k and v in both (its output equals the unquantized one's)."""
    q, k, v, kc, vc, meta = make_case(specs, 4, 2, 64, 16, torch.float32, tree=tree, seed=len(specs))
    kq, vq, (ks, vs) = _quantized(kc, vc, code)
    c1 = [x.clone() for x in (kq, vq, ks, vs)]
    c2 = [x.clone() for x in (kq, vq, ks, vs)]
    ref = TorchBackend().forward(q, k, v, c1[0], c1[1], TorchBackend().plan(meta), 0.125, kv_scales=(c1[2], c1[3]))
    be = get_backend("triton", torch.device("cpu"))
    be.mixed_decode_min = 0  # a mixed step's leading decodes go to Flash-Decoding
    plan = be.plan(meta)
    out = be.forward(q, k, v, c2[0], c2[1], plan, 0.125, kv_scales=(c2[2], c2[3]))
    assert all(torch.equal(_bytes(a) if a.dtype != torch.float32 else a, _bytes(b) if b.dtype != torch.float32 else b)
               for a, b in zip(c1, c2))
    assert rel_err(out, ref) < TOL[torch.float32]
    if plan.fresh_prefill:
        plain = TorchBackend().forward(q, k, v, kc.clone(), vc.clone(), TorchBackend().plan(meta), 0.125)
        assert rel_err(out, plain) < TOL[torch.float32]


@pytest.mark.parametrize("code", CODES)
def test_torch_backend_cpu_decode_path_quantized(code):
    """The CPU serving path (gather, dequantize, SDPA) against the plain batched reference."""
    q, k, v, kc, vc, meta = make_case([(n - 1, 1) for n in (1, 15, 17, 40)], 6, 2, 32, 16, torch.float32, seed=9)
    kq, vq, (ks, vs) = _quantized(kc, vc, code)
    c_ref = [x.clone() for x in (kq, vq, ks, vs)]
    store_kv_ref(k, v, c_ref[0], c_ref[1], meta.slot_mapping, (c_ref[2], c_ref[3]))
    ref = _decode_batched_ref(q, c_ref[0], c_ref[1], meta, 32**-0.5, (c_ref[2], c_ref[3]))
    out = TorchBackend().forward(q, k, v, kq, vq, TorchBackend().plan(meta), 32**-0.5, kv_scales=(ks, vs))
    assert torch.equal(_bytes(kq), _bytes(c_ref[0])) and torch.equal(ks, c_ref[2])
    assert rel_err(out, ref) < TOL[torch.float32]


def test_kernels_reject_mismatched_caches_and_scales():
    q, k, v, kc, vc, meta = make_case([(5, 1)], 4, 2, 32, 8, torch.float32)
    kq, vq, (ks, vs) = _quantized(kc, vc, torch.int8)
    args = (meta.block_tables, meta.seq_lens, 0.1)
    with pytest.raises(ValueError, match="needs kv_scales"):
        flash_decode(q, kq, vq, *args)
    with pytest.raises(TypeError, match="go with int8 / float8_e4m3fn caches"):
        flash_decode(q, kc, vc, *args, kv_scales=(ks, vs))
    with pytest.raises(ValueError, match="k_scale must be float32"):
        flash_decode(q, kq, vq, *args, kv_scales=(ks.transpose(1, 2), vs))
    with pytest.raises(ValueError, match="v_scale must be float32"):
        store_kv(k, v, kq, vq, meta.slot_mapping, (ks, vs.double()))
    with pytest.raises(ValueError, match="needs kv_scales"):
        paged_attention(q, kq, vq, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.1,
                        meta.query_lens_cpu, meta.seq_lens_cpu)
    # the reference backend checks the same (codes must never be read as values)
    with pytest.raises(ValueError, match="needs kv_scales"):
        TorchBackend().forward(q, k, v, kq, vq, meta, 0.1)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        TorchBackend().forward(q, k, v, kq, vq, meta, 0.1, kv_scales=(ks[:, :1], vs))
    with pytest.raises(TypeError, match="go with int8 / float8_e4m3fn caches"):
        TorchBackend().forward(q, k, v, kc, vc, meta, 0.1, kv_scales=(ks, vs))


# ---- the engine -----------------------------------------------------------------------------------

CFG = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
           rms_norm_eps=1e-6, tie_word_embeddings=False, model_type="llama", architectures=["LlamaForCausalLM"],
           num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_random_hf_folder(tmp_path_factory.mktemp("kvq"), CFG, std=0.3)


def _hf_with_kv_codes(folder: str, code: torch.dtype):
    """HF's model whose attention, in decode steps (one query), reads every key and value through
    quantize -> dequantize per (token, head): what the engine's cache holds. Prefill attends over the
    exact keys, as the engine's prefill of a prompt with nothing cached does."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attn(module, query, key, value, attention_mask, **kw):
        if query.shape[2] == 1:
            key, value = (dequantize_kv_ref(*quantize_kv_ref(x, code)) for x in (key, value))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    name = f"kv_codes_{str(code).split('.')[-1]}"  # (a name with "flash" in it means flash-attn to HF)
    AttentionInterface.register(name, attn)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation=name).eval()


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 211, (n,), generator=g).tolist() for n in (1, 7, 16, 33)]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_engine_greedy_matches_hf_reading_quantized_kv(folder, kv):
    """Greedy decoding over an int8 / e4m3 cache equals HF transformers whose decode-step attention
    reads K/V through the same per-(token, head) quantization; the unquantized HF model's output
    differs (the cache really is quantized); the blocks all come back."""
    from transformers import AutoModelForCausalLM

    code = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv]
    hf_q = _hf_with_kv_codes(folder, code)
    prompts = _prompts()
    llm = LLM(folder, kv_cache_dtype=kv, block_size=4, max_model_len=96, num_kv_blocks=64)
    runner = llm.llm_engine.runner
    assert runner.kv_cache.dtype == code and runner.kv_scale.shape == (2, 2, 64, 2, 4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == [hf_greedy(hf_q, p, 20) for p in prompts]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert got != [hf_greedy(hf, p, 20) for p in prompts]
    assert llm.llm_engine.kv.num_free_blocks == 64


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_engine_triton_equals_torch_backend_through_chunks_prefix_hits_and_preemption(folder, kv):
    """The Triton kernels (interpreter) and the reference backend on a quantized cache: the same greedy
    tokens through chunked prefill, prefix-cache hits, preemption, and n > 1 (copy-on-write of a shared
    partial block copies its scales too)."""
    prompts = _prompts()
    shared = prompts[3][:20]
    prompts = prompts + [shared + [5, 6, 7], shared + [9]]
    outs = {}
    for be in ("torch", "triton"):
        llm = LLM(folder, kv_cache_dtype=kv, attention_backend=be, block_size=4, max_num_batched_tokens=24,
                  max_model_len=96, num_kv_blocks=28)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        par = llm.generate([{"prompt_token_ids": prompts[2]}],
                           SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
        eng = llm.llm_engine
        assert eng.scheduler.num_preemptions > 0
        assert eng.kv.num_free_blocks == 28
        outs[be] = ([o.outputs[0].token_ids for o in res], [c.token_ids for c in par[0].outputs])
    assert outs["torch"] == outs["triton"]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_engine_spec_tree_on_quantized_cache_is_lossless(folder, kv):
    """Speculative decoding with a token tree (early exit: the draft layer shares the quantized cache)
    keeps greedy output equal to plain greedy: the accepted nodes' codes and scales move next to the
    root (compaction), and rejected nodes are never read."""
    prompts = _prompts()
    kw = dict(kv_cache_dtype=kv, block_size=4, max_model_len=96, num_kv_blocks=80)
    plain = LLM(folder, **kw).generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm = LLM(folder, speculative_config=dict(method="early_exit", num_layers=1, tree=[2, 2, 1]), **kw)
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    (stats,) = llm.llm_engine.spec.stats().values()
    assert stats["num_draft_tokens"] > stats["num_accepted_tokens"] > 0  # some nodes were rejected


def test_kv_cache_dtype_sizes_the_pool_and_rejects_bad_values(folder, monkeypatch):
    monkeypatch.setenv("PAGEFLASH_CPU_KV_CACHE_GB", "0.002")  # under the max_num_seqs x max_model_len cap
    base = LLM(folder, block_size=16, max_model_len=96).llm_engine.runner
    q8 = LLM(folder, kv_cache_dtype="int8", block_size=16, max_model_len=96).llm_engine.runner
    # float32 model (head_dim 16): 4 bytes per element vs 1 byte + 4 bytes of scale per 16-element row
    assert base.cfg.head_dim == 16
    assert base.kv_bytes_per_block() == 2 * 2 * 16 * 2 * 16 * 4
    assert q8.kv_bytes_per_block() == 2 * 2 * 16 * 2 * (16 + 4)
    assert q8.kv_cache.shape[2] > 3 * base.kv_cache.shape[2]
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        LLM(folder, kv_cache_dtype="int4")
