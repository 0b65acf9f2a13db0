"""Quantized KV cache on CUDA (kv_cache_dtype int8 / fp8): the stores and the attention kernels at
llama-3-8b head shapes in bf16 against the float32 references, and the engine's greedy tokens through
the Triton kernels and decode graphs against the reference backend."""

import pytest
import torch

from pageflash import LLM, SamplingParams
from pageflash.kernels.flash_decoding import choose_num_splits, flash_decode, flash_decode_ref
from pageflash.kernels.kv_store import store_kv
from pageflash.kernels.paged_attention import paged_attention
from pageflash.kernels.rotary import apply_rotary
from pageflash.layers.attention import (
    AttentionMetadata, dequantize_kv_ref, paged_attention_ref, quantize_kv_ref, store_kv_ref,
)

CODES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
HQ, HKV, D, PAGE = 32, 8, 128, 16


def _rel(a, b):
    assert not torch.isnan(a).any()
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _cache(nb, code, g, hkv=HKV, d=D, v_mag=1.0):
    """Random bf16 K / V (V times v_mag) of nb blocks as codes + scales: (k codes, v codes, (k scales,
    v scales))."""
    kc = torch.randn(nb, PAGE, hkv, d, device="cuda", generator=g).to(torch.bfloat16)
    vc = (torch.randn(nb, PAGE, hkv, d, device="cuda", generator=g) * v_mag).to(torch.bfloat16)
    out = []
    for c in (kc, vc):
        codes, s = quantize_kv_ref(c, code)
        out += [codes, s.transpose(1, 2).contiguous()]
    return out[0], out[2], (out[1], out[3])


@pytest.mark.parametrize("kv", sorted(CODES))
def test_store_kv_bf16(kv, poison_outputs):
    """Codes within one step of the reference's (the division may round differently), scales equal."""
    code = CODES[kv]
    g = torch.Generator(device="cuda").manual_seed(0)
    t, nb = 700, 64
    k = (torch.randn(t, HKV, D, device="cuda", generator=g) * 4).to(torch.bfloat16)
    v = torch.randn(t, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(nb * PAGE, device="cuda", generator=g)[:t]
    slots[::7] = -1
    caches = [torch.zeros(nb, PAGE, HKV, D, device="cuda", dtype=code) for _ in range(2)]
    scales = [torch.zeros(nb, HKV, PAGE, device="cuda") for _ in range(2)]
    ref_c = [x.clone() for x in caches]
    ref_s = [x.clone() for x in scales]
    store_kv(k, v, *caches, slots, tuple(scales))
    store_kv_ref(k, v, *ref_c, slots, tuple(ref_s))
    for c, s, rc, rs in zip(caches, scales, ref_c, ref_s):
        assert torch.equal(s, rs)
        step = rs.transpose(1, 2).unsqueeze(-1) * (1.0 if code == torch.int8 else 32.0)  # e4m3: 32 below 448
        diff = (dequantize_kv_ref(c, s.transpose(1, 2)) - dequantize_kv_ref(rc, rs.transpose(1, 2))).abs()
        assert (diff <= step * 1.001).all()
        assert (c.view(torch.uint8) != rc.view(torch.uint8)).float().mean() < 1e-3


def _decode_case(b, L, code, g, hq=HQ, hkv=HKV, d=D, v_mag=1.0):
    """b sequences of L // 2 .. L keys over a quantized cache of shuffled blocks (3 spare): (q, k codes,
    v codes, scales, block tables, seq_lens, the split count the engine would choose)."""
    nbs = -(-L // PAGE)
    kq, vq, sc = _cache(b * nbs + 3, code, g, hkv, d, v_mag)
    bt = torch.randperm(b * nbs + 3, device="cuda", generator=g)[: b * nbs].to(torch.int32).view(b, nbs)
    sl = torch.randint(max(1, L // 2), L + 1, (b,), device="cuda", generator=g, dtype=torch.int32)
    q = torch.randn(b, hq, d, device="cuda", generator=g).to(torch.bfloat16)
    splits = choose_num_splits(b, hkv, nbs * PAGE, torch.cuda.get_device_properties(0).multi_processor_count)
    return q, kq, vq, sc, bt, sl, splits


@pytest.mark.parametrize("kv", sorted(CODES))
@pytest.mark.parametrize("b,L", [(1, 8192), (8, 2048), (64, 512), (256, 100)])
def test_flash_decode_bf16(kv, b, L, poison_outputs):
    g = torch.Generator(device="cuda").manual_seed(b)
    q, kq, vq, sc, bt, sl, splits = _decode_case(b, L, CODES[kv], g)
    ref = flash_decode_ref(q.float(), kq, vq, bt, sl, D**-0.5, kv_scales=sc)
    for s in sorted({1, splits}):
        out = flash_decode(q, kq, vq, bt, sl, D**-0.5, num_splits=s, kv_scales=sc)
        assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("kv", sorted(CODES))
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (32, 8, 128)])
@pytest.mark.parametrize("b,L", [(8, 2048), (64, 700)])
def test_flash_decode_bf16_value_ranges(kv, hq, hkv, d, b, L, poison_outputs):
    """Over e4m3 codes a bf16 q meets the codes in float16 (flash_decoding.decode_config's F16_CODES),
    V's weights scaled to [0, 1] by the tile's largest scale: values of V near 1e-3 (weights otherwise in
    float16's subnormals) keep the reference's precision, at both head sizes' configs; a q beyond
    float16's range (1e6) is clamped, not turned into inf / NaN, and the output stays a convex
    combination of V's rows."""
    g = torch.Generator(device="cuda").manual_seed(b + d)
    q, kq, vq, sc, bt, sl, splits = _decode_case(b, L, CODES[kv], g, hq, hkv, d, 1e-3)
    v_max = dequantize_kv_ref(vq, sc[1].transpose(1, 2)).abs().max()  # = max |V| (a row's max: a full code)
    ref = flash_decode_ref(q.float(), kq, vq, bt, sl, d**-0.5, kv_scales=sc)
    for s in sorted({1, splits}):
        out = flash_decode(q, kq, vq, bt, sl, d**-0.5, num_splits=s, kv_scales=sc)
        assert _rel(out, ref) < 1e-2
        big = flash_decode(q * 1e6, kq, vq, bt, sl, d**-0.5, num_splits=s, kv_scales=sc)
        assert torch.isfinite(big).all()
        assert big.float().abs().max() <= v_max * 1.02


@pytest.mark.parametrize("kv", sorted(CODES))
def test_flash_decode_rope_store_bf16(kv, poison_outputs):
    """Rotary + store + decode in one launch == apply_rotary's fused store, then flash_decode."""
    code = CODES[kv]
    g = torch.Generator(device="cuda").manual_seed(5)
    b, L = 48, 300
    nbs = -(-L // PAGE)
    kq, vq, (ks, vs) = _cache(b * nbs, code, g)
    bt = torch.randperm(b * nbs, device="cuda", generator=g).to(torch.int32).view(b, nbs)
    sl = torch.randint(1, L + 1, (b,), device="cuda", generator=g, dtype=torch.int32)
    pos = (sl - 1).long()
    slots = (bt.gather(1, (pos // PAGE).view(-1, 1)).view(-1).long() * PAGE + pos % PAGE)
    q = torch.randn(b, HQ, D, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(b, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(b, HKV, D, device="cuda", generator=g).to(torch.bfloat16)
    ang = torch.rand(L, D // 2, device="cuda", generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    ref_c = [x.clone() for x in (kq, vq, ks, vs)]
    q2, k2 = q.clone(), k.clone()
    apply_rotary(q2, k2, pos, cos, sin, v=v, k_cache=ref_c[0], v_cache=ref_c[1], slot_mapping=slots,
                 kv_scales=(ref_c[2], ref_c[3]))
    ref = flash_decode_ref(q2.float(), ref_c[0], ref_c[1], bt, sl, D**-0.5, kv_scales=(ref_c[2], ref_c[3]))
    splits = choose_num_splits(b, HKV, nbs * PAGE, torch.cuda.get_device_properties(0).multi_processor_count)
    out = flash_decode(q, kq, vq, bt, sl, D**-0.5, num_splits=splits, rope=(pos, cos, sin), k_new=k, v_new=v,
                       slot_mapping=slots, kv_scales=(ks, vs))
    for a, r in zip((kq, vq, ks, vs), ref_c):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           r.view(torch.uint8) if r.dtype != torch.float32 else r)
    assert _rel(out, ref) < 1e-2


@pytest.mark.parametrize("kv", sorted(CODES))
@pytest.mark.parametrize("specs,tree", [([(0, 300), (500, 200), (33, 1)], False),
                                        ([(1000, 6), (40, 4), (2000, 8)], True)])
def test_paged_attention_bf16(kv, specs, tree, poison_outputs):
    code = CODES[kv]
    g = torch.Generator(device="cuda").manual_seed(len(specs))
    lens = [c + n for c, n in specs]
    nbs = [-(-s // PAGE) for s in lens]
    kq, vq, sc = _cache(sum(nbs) + 2, code, g)
    perm = torch.randperm(sum(nbs) + 2, device="cuda", generator=g).to(torch.int32)
    bt = torch.zeros(len(specs), max(nbs), dtype=torch.int32, device="cuda")
    o = 0
    for i, n in enumerate(nbs):
        bt[i, :n] = perm[o:o + n]
        o += n
    qlens = [n for _, n in specs]
    t = sum(qlens)
    q = torch.randn(t, HQ, D, device="cuda", generator=g).to(torch.bfloat16)
    qsl = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    tm = None
    if tree:
        tm = torch.zeros(t, max(qlens), dtype=torch.bool, device="cuda")
        r = 0
        for n in qlens:
            for j in range(n):
                tm[r + j, 0] = tm[r + j, j] = True
                tm[r + j, (j - 1) // 2 * 2 if j > 1 else 0] = True
            r += n
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(qsl, sl, bt, torch.full((t,), -1, device="cuda"), qlens, lens, PAGE, tm)
    ref = paged_attention_ref(q.float(), kq, vq, meta, D**-0.5, sc)
    for splits in (1, 4):
        out = paged_attention(q, kq, vq, qsl, sl, bt, D**-0.5, qlens, lens, tree_mask=tm, num_splits=splits,
                              kv_scales=sc)
        assert _rel(out, ref) < 1e-2


PROMPTS = [[(7 * i + j) % 1000 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33, 64, 100, 1, 250, 16))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def run(model="smollm2-135m", **kw):
    llm = LLM(model, load_format="dummy", max_model_len=512, num_kv_blocks=512, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("kv", sorted(CODES))
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen3-0.6b"])
def test_engine_triton_graphs_equal_torch_backend_fp32(model, kv):
    """The Triton store / decode / prefill kernels in decode graphs give the reference backend's tokens
    (float32; the codes may differ where a division rounds differently, which these prompts never turn
    into another token)."""
    fast, llm = run(model, dtype="float32", kv_cache_dtype=kv)
    assert llm.llm_engine.runner.graphs is not None and llm.llm_engine.runner.kv_cache.dtype == CODES[kv]
    ref, _ = run(model, dtype="float32", kv_cache_dtype=kv, attention_backend="torch", enforce_eager=True)
    assert fast == ref


@pytest.mark.parametrize("kv", sorted(CODES))
def test_engine_graphs_equal_eager_bf16(kv):
    eager, _ = run(dtype="bfloat16", kv_cache_dtype=kv, enforce_eager=True)
    graphs, llm = run(dtype="bfloat16", kv_cache_dtype=kv)
    assert llm.llm_engine.runner.graphs is not None
    assert graphs == eager
