"""The attention kernels at full size on CUDA (bf16 mostly; fp16/fp32 and odd head dims too), against
float32 references; decode under CUDA-graph capture and replay."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from pageflash.kernels.backend import TritonBackend
from pageflash.kernels.flash_attention import (
    flash_attention,
    flash_attention_ref,
    flash_attn_varlen,
    flash_attn_varlen_fwd,
    flash_attn_varlen_ref,
)
from pageflash.kernels.flash_decoding import choose_num_splits, flash_decode, flash_decode_ref
from pageflash.kernels.kv_store import store_kv, store_kv_ref
from pageflash.kernels.paged_attention import paged_attention, paged_attention_ref
from pageflash.layers.attention import AttentionMetadata, TorchBackend

DEV = "cuda"
TOL = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 1e-4}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in output (unwritten or poisoned elements)"
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


# every buffer the launchers allocate starts as NaN (ints: -12345): unwritten outputs show
pytestmark = pytest.mark.usefixtures("poison_outputs")


def rnd(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device=DEV, dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------------------------------------- FA2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_fa_forward(d, causal, dtype):
    torch.manual_seed(d)
    b, hq, hkv, n = 2, 8, 2, 777
    q, k, v = rnd(b, hq, n, d, dtype=dtype), rnd(b, hkv, n, d, dtype=dtype), rnd(b, hkv, n, d, dtype=dtype)
    o = flash_attention(q, k, v, causal=causal)
    ref, _ = flash_attention_ref(q, k, v, causal=causal)
    assert rel_err(o, ref) < TOL[dtype]


@pytest.mark.parametrize("shape", [(4, 32, 4096, 128), (16, 16, 2048, 64), (1, 32, 16384, 128)])
def test_fa_forward_workload_shapes_vs_sdpa(shape):
    """The W-attn-prefill shapes, against SDPA's math in fp32 on a slice of heads (memory)."""
    torch.manual_seed(0)
    b, h, n, d = shape
    q, k, v = (rnd(b, h, n, d) for _ in range(3))
    o = flash_attention(q, k, v, causal=True)
    hs = slice(0, 2)
    ref = F.scaled_dot_product_attention(q[:1, hs].float(), k[:1, hs].float(), v[:1, hs].float(), is_causal=True)
    assert rel_err(o[:1, hs], ref) < TOL[torch.bfloat16]


def test_fa_varlen_lse():
    torch.manual_seed(1)
    lens = [1, 127, 128, 129, 2000, 63, 1024]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    t = sum(lens)
    q, k, v = rnd(t, 32, 128), rnd(t, 8, 128), rnd(t, 8, 128)
    o, lse = flash_attn_varlen_fwd(q, k, v, cu, max(lens))
    ref, lse_ref = flash_attn_varlen_ref(q, k, v, cu)
    assert rel_err(o, ref) < TOL[torch.bfloat16]
    assert rel_err(lse, lse_ref) < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d,heads", [(64, (8, 8)), (128, (8, 2)), (96, (4, 1)), (256, (2, 2))])
@pytest.mark.parametrize("causal", [True, False])
def test_fa_backward(d, heads, causal, dtype):
    torch.manual_seed(d)
    hq, hkv = heads
    b, n = 2, 513
    q, k, v = rnd(b, hq, n, d, dtype=dtype), rnd(b, hkv, n, d, dtype=dtype), rnd(b, hkv, n, d, dtype=dtype)
    do = rnd(b, hq, n, d, dtype=dtype)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    flash_attention(*xs, causal=causal).backward(do)
    rs = [x.float().requires_grad_() for x in (q, k, v)]
    flash_attention_ref(*rs, causal=causal)[0].backward(do.float())
    tol = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}[dtype]
    for name, a, r in zip("qkv", xs, rs):
        assert rel_err(a.grad, r.grad) < tol, name


def test_fa_backward_varlen():
    torch.manual_seed(2)
    lens = [300, 1, 129, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    t = sum(lens)
    q, k, v, do = rnd(t, 8, 128), rnd(t, 2, 128), rnd(t, 2, 128), rnd(t, 8, 128)
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    flash_attn_varlen(*xs, cu, max(lens)).backward(do)
    rs = [x.float().requires_grad_() for x in (q, k, v)]
    flash_attn_varlen_ref(*rs, cu)[0].backward(do.float())
    for name, a, r in zip("qkv", xs, rs):
        assert rel_err(a.grad, r.grad) < 3e-2, name


# ---------------------------------------------------------------------------------------------- paged


def make_case(specs, hq, hkv, d, page, dtype=torch.bfloat16, tree=False, seed=0, width_pad=3):
    """specs: [(context_len, query_len)]; random caches with shuffled physical blocks."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + n for c, n in specs]
    nblk = [(s + page - 1) // page for s in seq_lens]
    total = sum(nblk) + 5
    perm = torch.randperm(total, generator=g)
    width = max(nblk) + width_pad
    bt = torch.zeros(len(specs), width, dtype=torch.int32)
    pos = 0
    for i, nb in enumerate(nblk):
        bt[i, :nb] = perm[pos : pos + nb]
        pos += nb
    qlens = [n for _, n in specs]
    t = sum(qlens)
    slots = []
    for i, (c, n) in enumerate(specs):
        p = torch.arange(c, c + n)
        slots.append(bt[i, p // page].long() * page + p % page)
    tm = None
    if tree:
        tm = torch.zeros(t, max(qlens), dtype=torch.bool)
        row = 0
        for c, n in specs:
            parents = [-1] + [rng.randrange(0, j) for j in range(1, n)]
            for j in range(n):
                a = j
                while a >= 0:
                    tm[row + j, a] = True
                    a = parents[a]
            row += n
        tm = tm.to(DEV)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        block_tables=bt.to(DEV),
        slot_mapping=torch.cat(slots).to(DEV),
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
        block_size=page,
        tree_mask=tm,
    )
    kc, vc = rnd(total, page, hkv, d, dtype=dtype), rnd(total, page, hkv, d, dtype=dtype)
    q, k, v = rnd(t, hq, d, dtype=dtype), rnd(t, hkv, d, dtype=dtype), rnd(t, hkv, d, dtype=dtype)
    return q, k, v, kc, vc, meta


def test_store_kv_gpu():
    torch.manual_seed(0)
    k, v = rnd(1000, 8, 128), rnd(1000, 8, 128)
    kc, vc = rnd(100, 16, 8, 128), rnd(100, 16, 8, 128)
    slots = torch.randperm(1600, device=DEV)[:1000]
    slots[::7] = -1
    kr, vr = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    store_kv_ref(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)


PAGED = {
    "prefill": [(0, 1), (0, 15), (0, 16), (0, 17), (0, 1000), (0, 333)],
    "chunked": [(512, 512), (1000, 37), (16, 16), (3, 1), (0, 700)],
    "spec": [(2000, 5), (17, 8), (64, 1), (900, 4)],
}


@pytest.mark.parametrize("case", list(PAGED))
@pytest.mark.parametrize("heads,d", [((32, 8), 128), ((16, 16), 64), ((9, 3), 64), ((8, 1), 96), ((4, 2), 256)])
@pytest.mark.parametrize("page", [16, 32])
def test_paged_prefill_gpu(case, heads, d, page):
    hq, hkv = heads
    q, k, v, kc, vc, meta = make_case(PAGED[case], hq, hkv, d, page, seed=d + page)
    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    ref = paged_attention_ref(q, kc, vc, meta, d**-0.5)
    out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, d**-0.5,
                          meta.query_lens_cpu, meta.seq_lens_cpu)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_paged_tree_gpu(dtype):
    q, k, v, kc, vc, meta = make_case([(300, 16), (0, 9), (47, 31)], 32, 8, 128, 16, dtype=dtype, tree=True)
    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    ref = paged_attention_ref(q, kc, vc, meta, 0.1)
    out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.1,
                          meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("b,L", [(1, 32768), (8, 8192), (64, 2048), (1, 131072), (256, 1024), (5, 1), (7, 17)])
def test_decode_workload_shapes(b, L):
    """W-attn-decode shapes (ragged lengths up to L), splits as the backend chooses them."""
    torch.manual_seed(b)
    page, hq, hkv, d = 16, 32, 8, 128
    lens = [L] + [random.Random(i).randint(1, L) for i in range(b - 1)]
    nb = (L + page - 1) // page
    kc, vc = rnd(b * nb + 1, page, hkv, d), rnd(b * nb + 1, page, hkv, d)
    bt = torch.randperm(b * nb + 1, device=DEV)[: b * nb].to(torch.int32).view(b, nb)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = rnd(b, hq, d)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = choose_num_splits(b, hkv, nb * page, sms)
    out = flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits)
    ref = flash_decode_ref(q, kc, vc, bt, sl, d**-0.5)
    assert rel_err(out, ref) < TOL[torch.bfloat16]
    if splits > 1:
        assert rel_err(flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=1), ref) < TOL[torch.bfloat16]
        counters = torch.zeros(b * hkv, dtype=torch.int32, device=DEV)
        for _ in range(3):
            out = flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits, counters=counters)
            assert rel_err(out, ref) < TOL[torch.bfloat16]
            assert not counters.any()


@pytest.mark.parametrize("ahead,strided", [(0, False), (1, False), (0, True), (1, True)])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_decode_layouts_gpu(ahead, strided, stages):
    """The split kernel's switches at full size in bf16 (block ids ahead: deeper cp.async pipelines;
    1 stage: no copy pipeline, the default at D 128),
    ragged lengths, several split counts, with and without the fused combine."""
    torch.manual_seed(ahead + 2 * strided)
    b, L, page, hq, hkv, d = 8, 8192, 16, 32, 8, 128
    lens = [L] + [random.Random(i).randint(1, L) for i in range(b - 1)]
    nb = L // page
    kc, vc = rnd(b * nb + 1, page, hkv, d), rnd(b * nb + 1, page, hkv, d)
    bt = torch.randperm(b * nb + 1, device=DEV)[: b * nb].to(torch.int32).view(b, nb)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = rnd(b, hq, d)
    ref = flash_decode_ref(q, kc, vc, bt, sl, d**-0.5)
    cfg = dict(BLOCK_N=64, num_warps=4, num_stages=stages, BT_AHEAD=ahead, STRIDED=strided)
    counters = torch.zeros(b * hkv, dtype=torch.int32, device=DEV)
    for splits, cnt in ((1, None), (8, None), (33, None), (33, counters)):
        out = flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits, config=cfg, counters=cnt)
        assert rel_err(out, ref) < TOL[torch.bfloat16], (splits, cnt is not None)
    assert not counters.any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,d", [((32, 8), 128), ((9, 3), 64), ((8, 8), 80), ((16, 1), 256)])
def test_decode_dtypes_dims(heads, d, dtype):
    """Each config family of decode_config (D 64 split: 128-key tiles; D 65-128: 1 or 2 stages by the GPU;
    fp32 / D 256)."""
    hq, hkv = heads
    q, k, v, kc, vc, meta = make_case([(c, 1) for c in (0, 15, 16, 4000, 255)], hq, hkv, d, 16, dtype=dtype)
    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    ref = flash_decode_ref(q, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5)
    counters = torch.zeros(5 * hkv, dtype=torch.int32, device=DEV)
    for splits, cnt in ((1, None), (7, None), (7, counters), (3, counters)):
        out = flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5, num_splits=splits, counters=cnt)
        assert rel_err(out, ref) < TOL[dtype]
    assert not counters.any()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="programmatic dependent launch needs compute capability 9.0+")
@pytest.mark.parametrize("b,L", [(1, 32768), (8, 8192), (3, 1000)])
def test_decode_pdl_combine(b, L):
    """The combine as a programmatic dependent launch (PDL 1: signalled at the split kernel's start, 2:
    after its key loop): the same bits as without, eagerly and in a CUDA graph replayed with new
    lengths and queries (the graph keeps the programmatic edge)."""
    from pageflash.kernels.flash_decoding import decode_pdl

    assert decode_pdl(torch.device(DEV)) == 1  # the default on sm_90+
    torch.manual_seed(b)
    page, hq, hkv, d = 16, 32, 8, 128
    nb = (L + page - 1) // page
    kc, vc = rnd(b * nb + 1, page, hkv, d), rnd(b * nb + 1, page, hkv, d)
    bt = torch.randperm(b * nb + 1, device=DEV)[: b * nb].to(torch.int32).view(b, nb)
    sl = torch.tensor([L] + [random.Random(i).randint(1, L) for i in range(b - 1)], dtype=torch.int32, device=DEV)
    q = rnd(b, hq, d)
    splits = max(2, choose_num_splits(b, hkv, nb * page, torch.cuda.get_device_properties(0).multi_processor_count))
    base = flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits, config={"PDL": 0})
    assert rel_err(base, flash_decode_ref(q, kc, vc, bt, sl, d**-0.5)) < TOL[torch.bfloat16]
    for mode in (1, 2):
        assert torch.equal(flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits, config={"PDL": mode}), base)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits, config={"PDL": 1}, out=out)
    for seed in (1, 2):
        g = torch.Generator(device=DEV).manual_seed(seed)
        sl.copy_(torch.randint(1, L + 1, (b,), generator=g, device=DEV, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=g, device=DEV).to(q.dtype))
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits, config={"PDL": 0}))


def test_decode_cuda_graph_replay():
    """Capture the backend's decode step once, then replay with longer sequences and new slots."""
    torch.manual_seed(3)
    b, page, hq, hkv, d, width = 4, 16, 32, 8, 128, 128
    nblocks = b * width
    kc, vc = rnd(nblocks, page, hkv, d), rnd(nblocks, page, hkv, d)
    bt = torch.arange(nblocks, device=DEV, dtype=torch.int32).view(b, width)
    lens0 = [5, 100, 1000, 2000]
    sl = torch.tensor(lens0, dtype=torch.int32, device=DEV)
    slots = (bt[torch.arange(b), (sl - 1) // page].long() * page + (sl - 1) % page)
    q, k, v = rnd(b, hq, d), rnd(b, hkv, d), rnd(b, hkv, d)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=DEV), seq_lens=sl, block_tables=bt,
        slot_mapping=slots, query_lens_cpu=[1] * b, seq_lens_cpu=lens0, block_size=page,
    )
    be = TritonBackend()
    plan = be.plan(meta)
    assert plan.decode
    out = torch.empty(b, hq, d, device=DEV, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(be.forward(q, k, v, kc, vc, plan, d**-0.5))  # warm up: compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(be.forward(q, k, v, kc, vc, plan, d**-0.5))
    for lens in ([6, 101, 1001, 2001], [17, 1500, 1, 2047]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        slots.copy_(bt[torch.arange(b), (sl - 1) // page].long() * page + (sl - 1) % page)
        q.copy_(rnd(b, hq, d))
        k.copy_(rnd(b, hkv, d))
        v.copy_(rnd(b, hkv, d))
        graph.replay()
        kr, vr = kc.clone(), vc.clone()
        store_kv_ref(k, v, kr, vr, slots)
        assert torch.equal(kr, kc)
        ref = flash_decode_ref(q, kc, vc, bt, sl, d**-0.5)
        assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("fused_combine", [False, True])
def test_decode_rope_store_graph_replay(fused_combine):
    """The backend's decode with rope=: rotary, K/V store, attention (and the combine) in one launch,
    captured once and replayed with new lengths, slots and projections: the cache gets exactly what
    apply_rotary + store write, the output matches rotary-then-decode, a padded slot gives zeros."""
    from pageflash.kernels.rotary import apply_rotary

    torch.manual_seed(5)
    b, page, hq, hkv, d, width = 5, 16, 32, 8, 128, 512
    nblocks = b * width
    kc, vc = rnd(nblocks, page, hkv, d), rnd(nblocks, page, hkv, d)
    bt = torch.randperm(nblocks, device=DEV).to(torch.int32).view(b, width)
    sl = torch.ones(b, dtype=torch.int32, device=DEV)
    slots = torch.full((b,), -1, dtype=torch.int64, device=DEV)
    pos = torch.zeros(b, dtype=torch.int64, device=DEV)
    ang = torch.rand(8192, d // 2, device=DEV) * 100
    cos, sin = ang.cos(), ang.sin()
    q, k, v = rnd(b, hq, d), rnd(b, hkv, d), rnd(b, hkv, d)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(b + 1, dtype=torch.int32, device=DEV), seq_lens=sl, block_tables=bt,
        slot_mapping=slots, query_lens_cpu=[1] * b, seq_lens_cpu=[1] * b, block_size=page,
    )
    be = TritonBackend(fused_combine=fused_combine)
    assert be.decode_rope
    plan = be.plan(meta)
    out = torch.empty(b, hq, d, device=DEV, dtype=torch.bfloat16)
    fwd = lambda: out.copy_(be.forward(q, k, v, kc, vc, plan, d**-0.5, rope=(pos, cos, sin)))  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fwd()  # warm up: compile outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fwd()
    for lens in ([6, 101, 1001, 2001, 0], [17, 1500, 1, 8190, 300], [129, 130, 256, 257, 4096]):
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        live = sl > 0
        slots.copy_(torch.where(live, bt[torch.arange(b), (sl - 1).clamp_min(0) // page].long() * page
                                + (sl - 1).clamp_min(0) % page, -1))
        pos.copy_((sl - 1).clamp_min(0))
        q.copy_(rnd(b, hq, d))
        k.copy_(rnd(b, hkv, d))
        v.copy_(rnd(b, hkv, d))
        kr, vr, qr, kn = kc.clone(), vc.clone(), q.clone(), k.clone()
        graph.replay()
        apply_rotary(qr, kn, pos, cos, sin, v=v, k_cache=kr, v_cache=vr, slot_mapping=slots)
        assert torch.equal(kr, kc) and torch.equal(vr, vc)
        ref = flash_decode_ref(qr, kc, vc, bt, sl, d**-0.5)
        ref[~live] = 0
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        assert not out[~live].any()


@pytest.mark.parametrize("specs,tree", [([(0, 1)] * 3 + [(77, 1)], False), ([(0, 300), (40, 1), (9, 64)], False),
                                        ([(100, 6), (3, 4)], True)])
def test_backend_vs_torch_gpu(specs, tree):
    q, k, v, kc, vc, meta = make_case(specs, 32, 8, 128, 16, tree=tree)
    kc2, vc2 = kc.clone(), vc.clone()
    ref = TorchBackend().forward(q, k, v, kc, vc, meta, 0.09)
    be = TritonBackend()
    out = be.forward(q, k, v, kc2, vc2, be.plan(meta), 0.09)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("splits", [4, 33])
def test_paged_split_keys_gpu(tree, splits):
    """Verify-step shapes (few queries over long contexts) with the keys split over programs."""
    q, k, v, kc, vc, meta = make_case([(5000, 6), (17, 6), (1200, 3), (0, 2)], 32, 8, 128, 16, tree=tree, seed=splits)
    store_kv_ref(k, v, kc, vc, meta.slot_mapping)
    ref = paged_attention_ref(q, kc, vc, meta, 128**-0.5)
    out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 128**-0.5,
                          meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask, num_splits=splits)
    assert rel_err(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("b,v", [(1, 128256), (8, 128256), (3, 49152), (64, 32000), (2, 1000)])
def test_argmax_bf16_and_fp32(b, v):
    """kernels/argmax.py (the decode graphs' greedy token) equals torch.argmax at vocab sizes of
    llama-3, smollm2 and llama-2, with planted ties across chunk borders."""
    from pageflash.kernels.argmax import argmax

    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(b, v, device="cuda").to(dtype)
        x[0, [v // 2, v // 2 - 1, v - 1]] = 100.0  # ties: the first wins
        assert torch.equal(argmax(x), x.argmax(-1))
