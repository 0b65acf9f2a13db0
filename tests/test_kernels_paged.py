"""Paged attention kernels (prefill / chunked / prefix hit / tree, Flash-Decoding) and the Triton backend
against the PyTorch references, under the Triton interpreter on CPU (tiny shapes)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from kernel_checks import poison_outputs  # noqa: F401  (autouse: outputs start poisoned)

from pageflash.kernels.backend import TritonBackend
from pageflash.kernels.flash_decoding import choose_num_splits, flash_decode, flash_decode_ref
from pageflash.kernels.paged_attention import page_ids_per_tile, paged_attention, paged_attention_ref
from pageflash.layers.attention import AttentionMetadata, TorchBackend, get_backend

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}



def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in output (unwritten or poisoned rows)"
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def make_case(specs, hq, hkv, d, page, dtype, tree=False, seed=0, extra_blocks=3, pad_width=1):
    """specs: [(context_len, query_len)] per sequence. Returns (q, k, v, k_cache, v_cache, meta) with
    random cache contents (context filled, new slots random too), shuffled physical blocks."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    seq_lens = [c + n for c, n in specs]
    nblk = [(s + page - 1) // page for s in seq_lens]
    total = sum(nblk) + extra_blocks
    perm = torch.randperm(total, generator=g).tolist()
    width = max(nblk) + pad_width
    bt = torch.zeros(len(specs), width, dtype=torch.int32)
    it = iter(perm)
    for i, nb in enumerate(nblk):
        for j in range(nb):
            bt[i, j] = next(it)
    k_cache = torch.randn(total, page, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(total, page, hkv, d, generator=g).to(dtype)
    qlens = [n for _, n in specs]
    t = sum(qlens)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    slots = []
    for i, (c, n) in enumerate(specs):
        for p in range(c, c + n):
            slots.append(int(bt[i, p // page]) * page + p % page)
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0).tolist()), dtype=torch.int32)
    tree_mask = None
    if tree:
        tm = torch.zeros(t, max(qlens), dtype=torch.bool)
        row = 0
        for c, n in specs:
            parents = [-1] + [rnd.randrange(0, j) for j in range(1, n)]  # random token tree
            for j in range(n):
                a = j
                while a >= 0:
                    tm[row + j, a] = True
                    a = parents[a]
            row += n
        tree_mask = tm
    meta = AttentionMetadata(
        query_start_loc=qsl,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=bt,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_lens_cpu=qlens,
        seq_lens_cpu=seq_lens,
        block_size=page,
        tree_mask=tree_mask,
    )
    return q, k, v, k_cache, v_cache, meta


# (context, query) per sequence: prefill, ragged lengths, length 1, block_size +- 1, chunked prefill
# with context in the cache, prefix hits, multi-token decode
PREFILL_CASES = {
    "prefill_ragged": [(0, 1), (0, 15), (0, 17), (0, 16), (0, 40)],
    "chunked": [(33, 9), (16, 16), (5, 1), (47, 20)],
    "spec_decode": [(30, 4), (1, 3), (64, 5)],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "case,heads,d",
    [
        ("prefill_ragged", (4, 1), 64),
        ("chunked", (4, 4), 80),
        ("chunked", (8, 1), 64),
        ("spec_decode", (6, 2), 32),
    ],
)
def test_paged_prefill(case, heads, d, dtype):
    hq, hkv = heads
    q, k, v, kc, vc, meta = make_case(PREFILL_CASES[case], hq, hkv, d, 16, dtype, seed=hash(case) % 1000)
    TorchBackend().forward(q, k, v, kc, vc, meta, 0.0)  # store the new K/V with the reference
    ref = paged_attention_ref(q, kc, vc, meta, d**-0.5)
    out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, d**-0.5,
                          meta.query_lens_cpu, meta.seq_lens_cpu)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,d", [((4, 2), 64), ((3, 1), 96)])
def test_paged_tree_mask(heads, d, dtype):
    hq, hkv = heads
    q, k, v, kc, vc, meta = make_case([(21, 6), (0, 5), (15, 7)], hq, hkv, d, 8, dtype, tree=True, seed=3)
    TorchBackend().forward(q, k, v, kc, vc, meta, 0.0)
    ref = paged_attention_ref(q, kc, vc, meta, 0.3)
    out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.3,
                          meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("per_page", [False, True])
@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 32), (64, 16)])
def test_paged_prefill_tiles(block_m, block_n, ahead, per_page):
    """Other tilings: BLOCK_N larger than a page, several queries per tile with GQA packing; block
    ids loaded in the tile's iteration or one ahead, and when ahead one per key or one per page
    (BT_PAGES; without BT_AHEAD the launcher keeps the per-key gather)."""
    q, k, v, kc, vc, meta = make_case([(19, 13), (0, 33), (40, 2)], 8, 2, 64, 8, torch.float32, seed=block_m)
    TorchBackend().forward(q, k, v, kc, vc, meta, 0.0)
    ref = paged_attention_ref(q, kc, vc, meta, 0.125)
    out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125,
                          meta.query_lens_cpu, meta.seq_lens_cpu,
                          config=dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4, num_stages=1, BT_AHEAD=ahead,
                                      BT_PAGES=per_page))
    assert rel_err(out, ref) < TOL[torch.float32]


def test_page_ids_per_tile():
    assert page_ids_per_tile(64, 16) == 4 and page_ids_per_tile(64, 8) == 8 and page_ids_per_tile(64, 64) == 1
    assert page_ids_per_tile(64, 128) == 1 and page_ids_per_tile(16, 32) == 1
    assert page_ids_per_tile(64, 4) == 0  # 16 pages a tile: one id per key
    assert page_ids_per_tile(64, 24) == 0 and page_ids_per_tile(16, 3) == 0  # tiles straddle page edges


@pytest.mark.parametrize("ahead", [0, 1])
@pytest.mark.parametrize("page", [2, 3, 4, 8, 16, 32])
def test_paged_prefill_page_sizes(page, ahead):
    """Block ids one per page (BT_PAGES) for every page-to-tile ratio: several pages a tile, one, a
    page holding several tiles, and pages whose edges fall inside tiles (the per-key fallback);
    chunks with context, with and without a sliding window. ahead=0: the per-key gather (per-page ids
    come only with the ids loaded ahead)."""
    q, k, v, kc, vc, meta = make_case([(19, 13), (0, 33), (40, 2)], 4, 2, 32, page, torch.float32, seed=page)
    TorchBackend().forward(q, k, v, kc, vc, meta, 0.0)
    cfg = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1, BT_AHEAD=ahead, BT_PAGES=True)
    args = (q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2, meta.query_lens_cpu,
            meta.seq_lens_cpu)
    assert rel_err(paged_attention(*args, config=cfg), paged_attention_ref(q, kc, vc, meta, 0.2)) < TOL[torch.float32]
    ref_w = paged_attention_ref(q, kc, vc, meta, 0.2, window=7)
    assert rel_err(paged_attention(*args, config=cfg, window=7), ref_w) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,d,splits", [((4, 1), 64, 1), ((8, 2), 80, 3), ((2, 2), 64, 4), ((8, 1), 32, 2)])
def test_flash_decode(heads, d, splits, dtype):
    hq, hkv = heads
    # lengths 1, block_size +- 1, a block boundary, longer: some splits are empty
    specs = [(0, 1), (14, 1), (15, 1), (16, 1), (52, 1)]
    q, k, v, kc, vc, meta = make_case(specs, hq, hkv, d, 16, dtype, seed=splits)
    ref = flash_decode_ref(q, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5)
    out = flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5, num_splits=splits)
    assert rel_err(out, ref) < TOL[dtype]
    # fused combine: the last split program of each (sequence, KV head) combines; counters reset to 0.
    # Sequences of one chunk (<= 16 keys here) are written by their one live split, without partials.
    counters = torch.zeros(len(specs) * hkv + 3, dtype=torch.int32)
    for _ in range(2):
        out = flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, d**-0.5, num_splits=splits,
                           counters=counters)
        assert rel_err(out, ref) < TOL[dtype]
        assert not counters.any()


def _rope_tables(n, rot, seed):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(n, rot // 2, generator=g) * 6.0
    return ang.cos(), ang.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,d,splits,fused,rot", [((4, 1), 64, 1, False, 64), ((8, 2), 80, 3, True, 80),
                                                      ((4, 2), 64, 4, False, 64), ((8, 2), 64, 5, True, 64),
                                                      ((8, 2), 80, 3, True, 48), ((4, 1), 64, 1, False, 16)])
def test_flash_decode_rope_store(heads, d, splits, fused, rot, dtype):
    """rope=: rotary + K/V store + decode in one launch equals apply_rotary (with its fused store)
    followed by flash_decode: the same caches bit for bit, the same outputs; the new key (the last of
    each sequence) is attended from registers, a padded slot (slot -1, seq_len 0) gives zeros and
    stores nothing. rot < d: partial rotary (tables [P, rot / 2]; the other dims pass through)."""
    from pageflash.kernels.rotary import apply_rotary

    hq, hkv = heads
    specs = [(0, 1), (15, 1), (16, 1), (33, 1), (70, 1)]
    q, k, v, kc, vc, meta = make_case(specs, hq, hkv, d, 16, dtype, seed=splits + 10)
    cos, sin = _rope_tables(80, rot, seed=splits)
    pos = (meta.seq_lens - 1).to(torch.int64)
    sl, slots = meta.seq_lens.clone(), meta.slot_mapping.clone()
    sl[3], slots[3], pos[3] = 0, -1, 0  # a padded batch slot
    kc_ref, vc_ref, q_ref, k_ref = kc.clone(), vc.clone(), q.clone(), k.clone()
    apply_rotary(q_ref, k_ref, pos, cos, sin, v=v, k_cache=kc_ref, v_cache=vc_ref, slot_mapping=slots)
    ref = flash_decode_ref(q_ref, kc_ref, vc_ref, meta.block_tables, sl, d**-0.5)
    ref[3] = 0
    q0, k0 = q.clone(), k.clone()
    counters = torch.zeros(len(specs) * hkv, dtype=torch.int32) if fused else None
    for _ in range(2):
        kc2, vc2 = kc.clone(), vc.clone()
        out = flash_decode(q, kc2, vc2, meta.block_tables, sl, d**-0.5, num_splits=splits, counters=counters,
                           rope=(pos, cos, sin), k_new=k, v_new=v, slot_mapping=slots)
        assert torch.equal(kc2, kc_ref) and torch.equal(vc2, vc_ref)
        assert torch.equal(out[3], torch.zeros_like(out[3]))
        assert rel_err(out, ref) < TOL[dtype]
        assert torch.equal(q, q0) and torch.equal(k, k0)  # inputs untouched
        if fused:
            assert not counters.any()
    with pytest.raises(ValueError, match="k_new, v_new and slot_mapping"):
        flash_decode(q, kc, vc, meta.block_tables, sl, 0.1, rope=(pos, cos, sin), k_new=k)
    with pytest.raises(ValueError, match="go with rope"):
        flash_decode(q, kc, vc, meta.block_tables, sl, 0.1, k_new=k, v_new=v, slot_mapping=slots)
    with pytest.raises(ValueError, match="cos must be float32"):
        flash_decode(q, kc, vc, meta.block_tables, sl, 0.1, rope=(pos, cos.double(), sin), k_new=k, v_new=v,
                     slot_mapping=slots)


@pytest.mark.parametrize("ahead,strided", [(0, False), (1, False), (0, True), (1, True)])
@pytest.mark.parametrize("splits,fused,rope", [(3, False, False), (7, True, True), (2, False, True)])
def test_flash_decode_layouts(ahead, strided, splits, fused, rope):
    """The split kernel's switches (block ids one tile ahead; contiguous or strided splits) give the
    reference's output, with and without the fused combine and the rotary + store, over lengths that
    leave some splits empty, BLOCK_N larger than a page, a padded slot, and block-table columns past
    each sequence's end poisoned (loaded ahead, never dereferenced)."""
    from pageflash.kernels.rotary import apply_rotary

    hq, hkv, d, page = 4, 2, 32, 8
    specs = [(0, 1), (8, 1), (30, 1), (100, 1), (16, 1)]
    q, k, v, kc, vc, meta = make_case(specs, hq, hkv, d, page, torch.float32, seed=ahead + 2 * splits)
    bt = meta.block_tables.clone()
    for i, s_len in enumerate(meta.seq_lens_cpu):
        bt[i, (s_len + page - 1) // page:] = 10**6  # far outside the cache
    sl, slots = meta.seq_lens.clone(), meta.slot_mapping.clone()
    sl[4], slots[4] = 0, -1  # a padded batch slot
    cfg = dict(BLOCK_N=16, num_warps=4, num_stages=1, BT_AHEAD=ahead, STRIDED=strided)
    counters = torch.zeros(len(specs) * hkv, dtype=torch.int32) if fused else None
    if rope:
        cos, sin = _rope_tables(128, d, seed=splits)
        pos = (sl - 1).clamp_min(0).to(torch.int64)
        kc_ref, vc_ref, q_ref, k_ref = kc.clone(), vc.clone(), q.clone(), k.clone()
        apply_rotary(q_ref, k_ref, pos, cos, sin, v=v, k_cache=kc_ref, v_cache=vc_ref, slot_mapping=slots)
        ref = flash_decode_ref(q_ref, kc_ref, vc_ref, meta.block_tables, sl, 0.2)
        out = flash_decode(q, kc, vc, bt, sl, 0.2, num_splits=splits, config=cfg, counters=counters,
                           rope=(pos, cos, sin), k_new=k, v_new=v, slot_mapping=slots)
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    else:
        ref = flash_decode_ref(q, kc, vc, meta.block_tables, sl, 0.2)
        out = flash_decode(q, kc, vc, bt, sl, 0.2, num_splits=splits, config=cfg, counters=counters)
    ref[4] = 0
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert rel_err(out, ref) < TOL[torch.float32]
    if fused:
        assert not counters.any()


@pytest.mark.parametrize("combine", [dict(BLOCK_DC=0, EAGER=False), dict(BLOCK_DC=16, EAGER=True),
                                     dict(BLOCK_DC=32, EAGER=False, num_warps=2), dict(BLOCK_DC=0, EAGER=True)])
@pytest.mark.parametrize("strided", [False, True])
def test_decode_combine_variants(combine, strided):
    """The combine's column chunks and eager partial loads: the live splits' partials weighted by their
    lse (torch reference), the dead splits' rows (NaN-poisoned, as stale memory may be) never reaching
    the output, rows whose one live split wrote O left alone, a padded slot (seq_len 0) untouched."""
    from pageflash.kernels.flash_decoding import combine_partials

    g = torch.Generator().manual_seed(7 + strided)
    rows, hq, s, d, block_n = 5, 3, 6, 48, 16
    seq_lens = torch.tensor([0, 10, 40, 16 * 6 + 3, 16 * 2], dtype=torch.int32)
    po = torch.randn(rows, hq, s, d, generator=g)
    plse = torch.randn(rows, hq, s, generator=g) * 3
    eff = []
    for r, n in enumerate(seq_lens.tolist()):
        if strided:
            e = min(max(-(-n // block_n), 1), s)
        else:
            chunk = -(-(-(-n // s)) // block_n) * block_n
            e = max(-(-n // max(chunk, 1)), 1)
        eff.append(e)
        po[r, :, e:] = float("nan")
        plse[r, :, e:] = float("nan")
    o = torch.full((rows, hq, d), 7.0)
    combine_partials(o, po, plse, lens=(seq_lens, block_n), strided=strided, config=combine)
    for r, e in enumerate(eff):
        if e == 1:
            assert torch.equal(o[r], torch.full((hq, d), 7.0)), r  # the split kernel wrote this row
            continue
        w = torch.softmax(plse[r, :, :e] * math.log(2), dim=-1)
        ref = (w[..., None] * po[r, :, :e]).sum(1)
        torch.testing.assert_close(o[r], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("combine", [dict(COMBINE_BLOCK_DC=16, COMBINE_EAGER=True), dict(COMBINE_EAGER=True)])
def test_flash_decode_combine_config(combine):
    """flash_decode passes COMBINE_* config keys to the combine: same output as the reference."""
    q, k, v, kc, vc, meta = make_case([(0, 1), (100, 1), (7, 1), (64, 1)], 8, 2, 32, 8, torch.float32, seed=9)
    ref = flash_decode_ref(q, kc, vc, meta.block_tables, meta.seq_lens, 0.2)
    cfg = dict(BLOCK_N=16, num_warps=4, num_stages=1, BT_AHEAD=1, STRIDED=True, **combine)
    out = flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.2, num_splits=5, config=cfg)
    assert rel_err(out, ref) < TOL[torch.float32]


def test_flash_decode_fused_combine_many_splits():
    """Many splits (40, of which 38 hold keys of the longest sequence, 1 of the others), fused combine."""
    q, k, v, kc, vc, meta = make_case([(0, 1), (300, 1), (7, 1)], 4, 1, 32, 8, torch.float32, seed=4)
    ref = flash_decode_ref(q, kc, vc, meta.block_tables, meta.seq_lens, 0.2)
    counters = torch.zeros(3, dtype=torch.int32)
    out = flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.2, num_splits=40, counters=counters,
                       config=dict(BLOCK_N=8, num_warps=4, num_stages=1))
    assert rel_err(out, ref) < TOL[torch.float32]
    assert not counters.any()


@pytest.mark.parametrize("splits", [1, 3])
def test_flash_decode_over_contiguous_buffers(splits):
    """bench.kernels.contiguous_as_cache: contiguous [B, Hkv, L, D] K/V seen as a paged cache (no copy);
    the kernel over it equals SDPA (GQA) over the contiguous tensors."""
    from pageflash.bench.kernels import contiguous_as_cache

    torch.manual_seed(splits)
    b, hq, hkv, L, d, page = 3, 4, 2, 48, 16, 16
    kk, vv = torch.randn(b, hkv, L, d), torch.randn(b, hkv, L, d)
    q = torch.randn(b, hq, d)
    kc, vc, bt = contiguous_as_cache(kk, vv, page)
    assert kc.data_ptr() == kk.data_ptr() and bt.shape == (b, L // page)
    sl = torch.full((b,), L, dtype=torch.int32)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.view(b, hq, 1, d), kk.repeat_interleave(hq // hkv, 1), vv.repeat_interleave(hq // hkv, 1),
        scale=d**-0.5).view(b, hq, d)
    assert rel_err(flash_decode_ref(q, kc, vc, bt, sl, d**-0.5), ref) < TOL[torch.float32]
    out = flash_decode(q, kc, vc, bt, sl, d**-0.5, num_splits=splits)
    assert rel_err(out, ref) < TOL[torch.float32]
    with pytest.raises(ValueError, match="multiple"):
        contiguous_as_cache(kk[:, :, :40].contiguous(), vv[:, :, :40].contiguous(), page)


def test_choose_num_splits():
    assert choose_num_splits(256, 8, 1024, 132) == 1  # batch fills the GPU
    assert choose_num_splits(64, 8, 2048, 132) == 1
    assert choose_num_splits(1, 8, 32768, 132) == 66  # one wave of 4 programs per SM
    assert choose_num_splits(8, 8, 8192, 132) == 8
    assert choose_num_splits(1, 8, 64, 132) == 1  # short bound: one chunk
    # short bounds: at least 16 splits of >= 64 keys (run 60), where the wave has room
    assert choose_num_splits(1, 8, 1024, 132) == 16
    assert choose_num_splits(1, 8, 2048, 132) == 16 and choose_num_splits(1, 8, 8192, 132) == 32
    assert choose_num_splits(1, 8, 512, 132) == 8 and choose_num_splits(1, 8, 100, 132) == 2
    assert choose_num_splits(16, 8, 1024, 132) == 4  # the wave's room caps the floor
    assert choose_num_splits(1, 8, 1024, 132, min_splits=1) == 4  # chunks of >= 256 keys only


def test_decode_min_splits_env(monkeypatch):
    from pageflash.kernels.flash_decoding import decode_min_splits

    try:
        monkeypatch.setenv("PAGEFLASH_DECODE_MIN_SPLITS", "1")
        decode_min_splits.cache_clear()
        assert choose_num_splits(1, 8, 1024, 132) == 4
        monkeypatch.setenv("PAGEFLASH_DECODE_MIN_SPLITS", "0")
        decode_min_splits.cache_clear()
        with pytest.raises(ValueError, match="PAGEFLASH_DECODE_MIN_SPLITS"):
            choose_num_splits(1, 8, 1024, 132)
    finally:
        monkeypatch.delenv("PAGEFLASH_DECODE_MIN_SPLITS")
        decode_min_splits.cache_clear()
    assert choose_num_splits(1, 8, 1024, 132) == 16


@pytest.mark.parametrize("splits,fused", [(1, False), (3, False), (3, True)])
def test_flash_decode_empty_sequence_slot(splits, fused):
    """A padded batch slot (seq_len 0) gives zeros, never NaN, and leaves the other rows exact."""
    q, k, v, kc, vc, meta = make_case([(20, 1), (5, 1), (40, 1)], 4, 2, 64, 16, torch.float32, seed=9)
    ref = flash_decode_ref(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125)
    sl = meta.seq_lens.clone()
    sl[1] = 0
    counters = torch.zeros(6, dtype=torch.int32) if fused else None
    out = flash_decode(q, kc, vc, meta.block_tables, sl, 0.125, num_splits=splits, counters=counters)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_err(out[[0, 2]], ref[[0, 2]]) < TOL[torch.float32]


def test_decode_stages_follow_bandwidth_per_sm(monkeypatch):
    """The D 65-128 decode config's copy-pipeline stages come from the GPU's peak bandwidth per SM:
    H100 SXM (3.35 TB/s, 132 SMs) keeps 1 stage, H200 (4.8 TB/s) takes 2; unknown bandwidth keeps 1;
    PAGEFLASH_DECODE_STAGES forces either and refuses anything else."""
    import types

    from pageflash.kernels import flash_decoding as fd

    def props(clock_mhz, bus_bits, sms=132):
        return types.SimpleNamespace(memory_clock_rate=clock_mhz * 1000, memory_bus_width=bus_bits,
                                     multi_processor_count=sms)

    h100, h200 = props(2619, 5120), props(3201, 6016)
    assert fd.memory_bandwidth_per_sm(h200) * 132 == pytest.approx(4.815e12, rel=1e-3)
    assert fd.memory_bandwidth_per_sm(h100) * 132 == pytest.approx(3.352e12, rel=1e-3)
    assert fd.stages_for_bandwidth(fd.memory_bandwidth_per_sm(h100)) == 1
    assert fd.stages_for_bandwidth(fd.memory_bandwidth_per_sm(h200)) == 2
    assert fd.memory_bandwidth_per_sm(types.SimpleNamespace(multi_processor_count=132)) is None
    assert fd.stages_for_bandwidth(None) == 1
    monkeypatch.setattr(fd.torch.cuda, "get_device_properties", lambda device: h200)
    assert fd.decode_stages(torch.device("cuda")) == 2
    monkeypatch.setenv("PAGEFLASH_DECODE_STAGES", "1")
    assert fd.decode_stages(torch.device("cuda")) == 1
    for bad in ("3", "two", "-1"):
        monkeypatch.setenv("PAGEFLASH_DECODE_STAGES", bad)
        with pytest.raises(ValueError, match="PAGEFLASH_DECODE_STAGES"):
            fd.decode_stages(torch.device("cuda"))


def test_decode_pdl_mode(monkeypatch):
    """The split decode's combine is a programmatic dependent launch on sm_90+ CUDA devices only
    (mode 1); PAGEFLASH_DECODE_PDL=0 turns it off, 1 / 2 force a mode where supported, anything else
    is refused; on the CPU (the interpreter) the PDL config is ignored and the result is unchanged."""
    from pageflash.kernels import flash_decoding as fd

    cuda = torch.device("cuda")
    assert fd.decode_pdl(torch.device("cpu")) == 0
    monkeypatch.setattr(fd.torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fd.pdl_supported(cuda) == hasattr(fd.tl.extra.cuda, "gdc_wait")
    if fd.pdl_supported(cuda):
        assert fd.decode_pdl(cuda) == 1
        monkeypatch.setenv("PAGEFLASH_DECODE_PDL", "2")
        assert fd.decode_pdl(cuda) == 2
    monkeypatch.setenv("PAGEFLASH_DECODE_PDL", "0")
    assert fd.decode_pdl(cuda) == 0
    for bad in ("3", "on", "-1"):
        monkeypatch.setenv("PAGEFLASH_DECODE_PDL", bad)
        with pytest.raises(ValueError, match="PAGEFLASH_DECODE_PDL"):
            fd.decode_pdl(cuda)
    monkeypatch.delenv("PAGEFLASH_DECODE_PDL")
    monkeypatch.setattr(fd.torch.version, "hip", "6.0", raising=False)  # ROCm: no griddepcontrol
    assert fd.decode_pdl(cuda) == 0
    monkeypatch.setattr(fd.torch.version, "hip", None, raising=False)
    monkeypatch.setattr(fd.torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert fd.decode_pdl(cuda) == 0
    q, k, v, kc, vc, meta = make_case([(40, 1), (7, 1)], 4, 2, 32, 16, torch.float32, seed=4)
    plain = flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.2, num_splits=3)
    assert torch.equal(flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.2, num_splits=3,
                                    config={"PDL": 1}), plain)
    with pytest.raises(ValueError, match="PDL"):
        flash_decode(q, kc, vc, meta.block_tables, meta.seq_lens, 0.2, num_splits=3, config={"PDL": 5})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "specs,tree",
    [
        ([(0, 1), (16, 1), (30, 1)], False),  # decode-only: Flash-Decoding
        ([(0, 9), (0, 1), (0, 20)], False),  # fresh prefill: contiguous varlen kernel
        ([(0, 9), (17, 1), (3, 16)], False),  # mixed prefill + decode
        ([(12, 4), (0, 3)], True),  # tree decode
        ([(300, 4), (20, 3)], True),  # tree verify over a long context: keys split (Flash-Decoding)
        ([(290, 5)], False),  # chain verify over a long context: keys split
        ([(16, 1), (30, 1), (0, 40)], False),  # decodes first, then a prefill: the decodes via Flash-Decoding
        ([(5, 1), (100, 1), (33, 20), (7, 1)], False),  # only the leading decodes go there
    ],
)
def test_backend_vs_torch(specs, tree, dtype):
    q, k, v, kc, vc, meta = make_case(specs, 4, 2, 64, 16, dtype, tree=tree, seed=len(specs))
    be = get_backend("triton", torch.device("cpu"))
    assert isinstance(be, TritonBackend) and be.name == "triton"
    be.mixed_decode_min = 0  # a mixed step's leading decodes go to Flash-Decoding
    kc2, vc2 = kc.clone(), vc.clone()
    ref = TorchBackend().forward(q, k, v, kc, vc, TorchBackend().plan(meta), 0.125)
    plan = be.plan(meta)
    assert plan.decode == meta.is_decode_only
    assert plan.fresh_prefill == (not plan.decode and not tree and all(c == 0 for c, _ in specs))
    lead = next((i for i, (_, n) in enumerate(specs) if n != 1), len(specs))
    assert plan.decode_prefix == (lead if not plan.fresh_prefill and max(n for _, n in specs) > 16 else 0)
    if max(meta.query_lens_cpu) > 1 and max(meta.seq_lens_cpu) > 256:  # the split path is taken
        from pageflash.kernels.backend import MAX_SPLIT_QUERY_LEN
        from pageflash.kernels.flash_decoding import choose_num_splits as cns

        assert meta.max_query_len <= MAX_SPLIT_QUERY_LEN and cns(len(specs), 2, plan.max_kv_len, 4) > 1
    out1 = be.forward(q, k, v, kc2, vc2, plan, 0.125)
    out2 = be.forward(q, k, v, kc2, vc2, plan, 0.125)  # second layer: cached plan pieces
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert rel_err(out1, ref) < TOL[dtype]
    assert torch.equal(out1, out2)


@pytest.mark.parametrize("specs", [[(0, 1), (16, 1), (30, 1)], [(0, 9), (17, 1), (3, 16)]])
def test_backend_rope_fused_with_store(specs):
    """forward(..., rope=(positions, cos, sin)) on unrotated q, k == rotary reference, then the
    reference backend: same caches (rotated k stored), same output; decode-only steps rotate inside
    the decode kernel."""
    from pageflash.kernels.rotary import apply_rotary_ref

    dtype = torch.float32
    q, k, v, kc, vc, meta = make_case(specs, 4, 2, 64, 16, dtype, seed=5)
    g = torch.Generator().manual_seed(1)
    pos = torch.cat([torch.arange(c, c + n) for c, n in specs])
    ang = torch.outer(torch.arange(64, dtype=torch.float32), torch.rand(32, generator=g))
    cos, sin = ang.cos(), ang.sin()
    qr, kr = apply_rotary_ref(q, k, pos, cos, sin)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    ref = TorchBackend().forward(qr, kr, v, kc_ref, vc_ref, TorchBackend().plan(meta), 0.125)
    be = get_backend("triton", torch.device("cpu"))
    assert be.fuses_rope
    q2, k2 = q.clone(), k.clone()
    plan = be.plan(meta)
    out = be.forward(q2, k2, v, kc, vc, plan, 0.125, rope=(pos, cos, sin))
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    if plan.decode:  # rotated inside the decode launch: q and k are left as they were
        assert be.decode_rope and torch.equal(q2, q) and torch.equal(k2, k)
    else:  # rotated in place by the rotary + store launch
        assert torch.equal(q2, qr) and torch.equal(k2, kr)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tree,splits", [(False, 2), (False, 5), (True, 3), (True, 8)])
def test_paged_split_keys(tree, splits, dtype):
    """Keys split over programs (Flash-Decoding for multi-token verify), partials combined by LSE: equal
    to the reference for chains and trees, including splits with no keys (short sequences)."""
    specs = [(70, 4), (1, 3), (33, 6), (0, 2)]
    q, k, v, kc, vc, meta = make_case(specs, 8, 2, 64, 8, dtype, tree=tree, seed=splits)
    TorchBackend().forward(q, k, v, kc, vc, meta, 0.0)
    ref = paged_attention_ref(q, kc, vc, meta, 0.125)
    out = paged_attention(q, kc, vc, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.125,
                          meta.query_lens_cpu, meta.seq_lens_cpu, tree_mask=meta.tree_mask,
                          config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1), num_splits=splits)
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,d", [((4, 1), 64), ((6, 2), 32), ((3, 3), 80)])
@pytest.mark.parametrize("lens", [[1, 15, 17, 16, 40], [33, 33], [5]])
def test_torch_backend_cpu_decode_path(heads, d, dtype, lens):
    """TorchBackend's CPU path (index_copy_ store, SDPA decode) against the plain references."""
    from pageflash.layers.attention import _decode_batched_ref, store_kv_ref  # noqa: PLC0415

    hq, hkv = heads
    q, k, v, kc, vc, meta = make_case([(n - 1, 1) for n in lens], hq, hkv, d, 16, dtype, seed=len(lens) + d)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv_ref(k, v, kc_ref, vc_ref, meta.slot_mapping)
    ref = _decode_batched_ref(q, kc_ref, vc_ref, meta, d**-0.5)
    out = TorchBackend().forward(q, k, v, kc, vc, TorchBackend().plan(meta), d**-0.5)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert rel_err(out, ref) < TOL[dtype]
    # a padding slot (-1) is skipped, as the reference does
    meta.slot_mapping[0] = -1
    kc2, vc2 = kc.clone(), vc.clone()
    kc2.view(-1)[:] = 0
    kc3 = kc2.clone()
    TorchBackend().forward(q, k, v, kc2, vc2, TorchBackend().plan(meta), d**-0.5)
    store_kv_ref(k, v, kc3, vc.clone(), meta.slot_mapping)
    assert torch.equal(kc2, kc3)


def test_mixed_step_leading_decodes_threshold(monkeypatch):
    """A mixed step's leading decodes go to Flash-Decoding only when they give at least
    mixed_decode_min programs per SM; either way the output equals the reference backend's, and the
    rows the paged kernel leaves to Flash-Decoding are written (outputs are NaN-poisoned)."""
    specs = [(16, 1), (30, 1), (9, 1), (0, 40)]
    q, k, v, kc, vc, meta = make_case(specs, 4, 2, 64, 16, torch.float32, seed=3)
    ref = TorchBackend().forward(q, k, v, kc.clone(), vc.clone(), meta, 0.125)
    calls = []
    import pageflash.kernels.backend as backend_mod

    real = backend_mod.flash_decode
    monkeypatch.setattr(backend_mod, "flash_decode", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    for need, used in ((3, True), (4, False)):  # 3 decodes x 2 KV heads = 6 programs on 2 SMs
        be = TritonBackend(num_sms=2)
        be.mixed_decode_min = need
        plan = be.plan(meta)
        assert plan.decode_prefix == 3
        calls.clear()
        out = be.forward(q, k, v, kc.clone(), vc.clone(), plan, 0.125)
        assert calls == ([3] if used else [])
        assert rel_err(out, ref) < TOL[torch.float32]
    monkeypatch.setenv("PAGEFLASH_MIXED_DECODE", "0")
    assert TritonBackend().plan(meta).decode_prefix == 0
