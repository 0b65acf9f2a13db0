"""Mixture-of-experts FFN (pageflash.kernels.fused_moe) under the Triton interpreter: moe_align's
grouping, the grouped-GEMM path against fused_moe_ref, fused_moe_ref against a dense per-token loop,
and input validation.

fp32 and fp16 only: bf16 arithmetic is wrong under the interpreter. Shapes are tiny (the interpreter
is slow); H and I are not multiples of the tiles, so the masks are exercised.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_checks import poison_outputs  # noqa: F401  (autouse: outputs start poisoned)

from pageflash.kernels.fused_moe import fused_moe, fused_moe_ref, max_blocks, moe_align

TOL = {torch.float32: 1e-5, torch.float16: 3e-3}
DTYPES = [torch.float32, torch.float16]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert not torch.isnan(a).any(), "NaN in output (unwritten or poisoned elements)"
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def make_inputs(t, h, inter, e, k, dtype, seed, id_dtype=torch.int64, routing="random"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    if routing == "random":  # k distinct experts per token
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    elif routing == "one":  # every slot of every token to one expert (duplicates within a token)
        ids = torch.full((t, k), e - 1)
    elif routing == "dup":  # few experts, repeated across tokens and within a token
        ids = torch.randint(0, 2, (t, k), generator=g)
    else:
        raise AssertionError(routing)
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return x, w13, w2, weights.float().contiguous(), ids.to(id_dtype).contiguous()


# ---------------------------------------------------------------------------------------- moe_align


def check_align(ids: torch.Tensor, e: int, bm: int) -> None:
    t, k = ids.shape
    p = t * k
    sorted_ids, block_expert, num_rows = moe_align(ids, e, bm)
    nblk = max_blocks(p, e, bm)
    assert nblk == (p + bm - 1) // bm + min(p, e)
    assert sorted_ids.dtype == block_expert.dtype == num_rows.dtype == torch.int32
    assert sorted_ids.shape == (nblk * bm,) and block_expert.shape == (nblk,) and num_rows.shape == (1,)
    flat = ids.reshape(-1).long()
    counts = torch.tensor([(flat == i).sum().item() for i in range(e)])
    rows = int(num_rows.item())
    assert rows == int(((counts + bm - 1) // bm * bm).sum())
    assert rows % bm == 0 and rows <= nblk * bm
    # every pair exactly once, everything else the sentinel, nothing past num_rows
    real = sorted_ids[sorted_ids != p]
    assert sorted(real.tolist()) == list(range(p))
    assert (sorted_ids[rows:] == p).all()
    # each used block holds only pairs of its expert; each expert's pairs fill ceil(count/bm) blocks
    blocks_of = torch.zeros(e, dtype=torch.int64)
    for b in range(rows // bm):
        blk = sorted_ids[b * bm:(b + 1) * bm].long()
        ex = int(block_expert[b])
        assert 0 <= ex < e
        pairs = blk[blk != p]
        assert pairs.numel() > 0, "a used block with no pair"
        assert (flat[pairs] == ex).all()
        blocks_of[ex] += 1
        # padding only at the end of an expert's group
        n_real = pairs.numel()
        assert (blk[:n_real] != p).all() and (blk[n_real:] == p).all()
    assert torch.equal(blocks_of, (counts + bm - 1) // bm)


@pytest.mark.parametrize("bm", [16, 64])
@pytest.mark.parametrize(
    "t,k,e,routing",
    [(1, 1, 4, "random"), (1, 3, 8, "random"), (17, 2, 8, "random"), (33, 1, 4, "random"),
     (40, 3, 8, "random"), (20, 2, 8, "one"), (25, 3, 4, "dup"), (5, 2, 8, "dup")],
)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_moe_align(t, k, e, routing, bm, id_dtype):
    _, _, _, _, ids = make_inputs(t, 4, 4, e, k, torch.float32, seed=t * 7 + k, id_dtype=id_dtype, routing=routing)
    check_align(ids, e, bm)


def test_moe_align_exact_blocks_and_unused_experts():
    """Counts that are exact multiples of block_m (no padding) next to empty experts."""
    ids = torch.tensor([3] * 16 + [0] * 32 + [5] * 1, dtype=torch.int32).view(-1, 1)
    check_align(ids, 8, 16)
    sorted_ids, block_expert, num_rows = moe_align(ids, 8, 16)
    assert num_rows.item() == 16 + 32 + 16
    assert block_expert[:4].tolist() == [0, 0, 3, 5]


# ---------------------------------------------------------------------------------------- reference


def dense_moe(x, w13, w2, weights, ids):
    """Token by token, slot by slot, all in float32 from the same (rounded) inputs."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            hid = w13[e].float() @ x[t].float()
            act = F.silu(hid[:inter]) * hid[inter:]
            out[t] += weights[t, j] * (w2[e].float() @ act)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,e,routing", [(1, 1, 4, "random"), (9, 2, 8, "random"), (12, 3, 4, "dup"), (6, 2, 4, "one")])
def test_ref_matches_dense_loop(t, k, e, routing, dtype):
    x, w13, w2, w, ids = make_inputs(t, 24, 20, e, k, dtype, seed=100 + t, routing=routing)
    ref = fused_moe_ref(x, w13, w2, w, ids)
    assert ref.dtype == dtype and ref.shape == x.shape
    dense = dense_moe(x, w13, w2, w, ids)
    assert rel_err(ref.float(), dense) < (1e-5 if dtype == torch.float32 else 5e-3)


# ---------------------------------------------------------------------------------------- fused_moe


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "t,e,k,routing,id_dtype",
    [(1, 4, 1, "random", torch.int32), (3, 8, 2, "random", torch.int64), (17, 8, 3, "random", torch.int32),
     (33, 4, 2, "random", torch.int64), (17, 4, 3, "one", torch.int64), (33, 8, 2, "dup", torch.int32)],
)
def test_fused_moe(t, e, k, routing, id_dtype, dtype):
    h, inter = 48, 40
    x, w13, w2, w, ids = make_inputs(t, h, inter, e, k, dtype, seed=t * 31 + e + k, id_dtype=id_dtype, routing=routing)
    ref = fused_moe_ref(x, w13, w2, w, ids)
    out = fused_moe(x, w13, w2, w, ids)
    assert out.shape == (t, h) and out.dtype == dtype
    assert rel_err(out, ref) < TOL[dtype]
    # out= is written in full (poisoned first) and returned
    buf = torch.full((t, h), float("nan"), dtype=dtype)
    res = fused_moe(x, w13, w2, w, ids, out=buf)
    assert res is buf
    assert torch.equal(buf, out)


def test_fused_moe_large_config():
    """T*k > 64: the large-tile config (block_m 64) and the grouped launch order."""
    t, e, k, h, inter = 40, 8, 2, 40, 24
    x, w13, w2, w, ids = make_inputs(t, h, inter, e, k, torch.float32, seed=5)
    ref = fused_moe_ref(x, w13, w2, w, ids)
    out = fused_moe(x, w13, w2, w, ids)
    assert rel_err(out, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,k,h,inter", [(3, 2, 136, 72), (40, 2, 80, 72)])
def test_fused_moe_k_loop(t, k, h, inter, dtype):
    """K spans several BLOCK_K tiles (decode config: H > 128; large config: H, I > 64), N several
    BLOCK_N tiles, and (large config) more m-blocks than one GROUP_M group."""
    x, w13, w2, w, ids = make_inputs(t, h, inter, 8, k, dtype, seed=h + inter)
    ref = fused_moe_ref(x, w13, w2, w, ids)
    out = fused_moe(x, w13, w2, w, ids)
    assert rel_err(out, ref) < TOL[dtype]


def test_fused_moe_weights_applied_per_slot():
    """A slot with weight 0 contributes nothing; one with weight 1 alone gives that expert's FFN."""
    x, w13, w2, _, _ = make_inputs(4, 32, 16, 4, 2, torch.float32, seed=9)
    ids = torch.tensor([[0, 1], [2, 3], [1, 1], [3, 0]], dtype=torch.int64)
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5], [1.0, 0.0]])
    out = fused_moe(x, w13, w2, w, ids)
    single = fused_moe(x, w13, w2, torch.ones(4, 1), ids[:, :1].contiguous())
    alt = fused_moe(x, w13, w2, torch.ones(4, 1), ids[:, 1:].contiguous())
    assert torch.allclose(out[0], single[0], rtol=1e-5, atol=1e-6)
    assert torch.allclose(out[1], alt[1], rtol=1e-5, atol=1e-6)
    assert torch.allclose(out[2], single[2], rtol=1e-5, atol=1e-6)
    assert torch.allclose(out[3], single[3], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(single[0], alt[0])


def test_fused_moe_empty_batch():
    x, w13, w2, w, ids = make_inputs(0, 16, 16, 4, 2, torch.float32, seed=1)
    out = fused_moe(x, w13, w2, w, ids)
    assert out.shape == (0, 16)


# ---------------------------------------------------------------------------------------- validation


def test_bad_inputs():
    x, w13, w2, w, ids = make_inputs(3, 32, 16, 4, 2, torch.float32, seed=2)
    with pytest.raises(ValueError, match="2\\*I"):
        fused_moe(x, w13[:, :31], w2, w, ids)  # odd second dim
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13[:, :24].contiguous(), w2, w, ids)  # 2I=24 -> I=12 but w2 has I=16
    with pytest.raises(ValueError, match="hidden size"):
        fused_moe(x[:, :16].contiguous(), w13, w2, w, ids)
    with pytest.raises(ValueError, match="w2"):
        fused_moe(x, w13, w2[:, :16].contiguous(), w, ids)
    with pytest.raises(ValueError, match="topk_weights"):
        fused_moe(x, w13, w2, w[:, :1].contiguous(), ids)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe(x, w13, w2, w, ids[:2].contiguous())
    with pytest.raises(ValueError, match="topk_ids must be int32 or int64"):
        fused_moe(x, w13, w2, w, ids.float())
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        fused_moe(x, w13, w2, w.half(), ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_moe(x, w13.half(), w2, w, ids)
    with pytest.raises(ValueError, match="contiguous"):
        fused_moe(torch.randn(32, 3).t(), w13, w2, w, ids)
    with pytest.raises(ValueError, match="out must be"):
        fused_moe(x, w13, w2, w, ids, out=torch.empty(3, 31))


# ---------------------------------------------------------------------------------------- route_align


ROUTINGS = [(1, 8, 2, True), (5, 6, 3, False), (17, 16, 4, True), (33, 4, 1, True), (40, 8, 8, False),
            (3, 128, 8, True)]
# 300 x 4 pairs: the grouping reads them in two chunks (two launches only: one program routes <= 16384 logits)
ALIGN_CASES = [r + (v,) for r in ROUTINGS for v in ("fused", "two", "two-compare")] + [
    (300, 5, 4, True, "two"), (300, 5, 4, True, "two-compare")]


@pytest.mark.parametrize("t,e,k,renorm,variant", ALIGN_CASES)
@pytest.mark.parametrize("bm", [16, 64])
def test_route_align_equals_route_then_moe_align(t, e, k, renorm, bm, variant, monkeypatch):
    """One launch (or two: routing, then grouping, by histogram or by comparison) gives route()'s
    experts and weights and moe_align()'s grouping (the same stable order), for full and partial
    expert counts (E a power of two or not, k = E)."""
    import pageflash.kernels.fused_moe as fm
    from pageflash.layers.moe import route

    monkeypatch.setattr(fm, "ALIGN_HIST", variant != "two-compare")
    g = torch.Generator().manual_seed(t * 100 + e)
    logits = torch.randn(t, e, generator=g) * 3
    w, ids, sorted_ids, block_expert, num_rows = fm.route_align(logits, k, renorm, bm, fused=variant == "fused")
    want_w, want_ids = route(logits, k, renorm)
    assert torch.equal(ids.long(), want_ids)
    torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
    ws, wb, wn = moe_align(want_ids, e, bm)
    assert int(num_rows) == int(wn)
    assert torch.equal(sorted_ids, ws)
    used = int(wn) // bm
    assert torch.equal(block_expert[:used], wb[:used])
    assert (block_expert >= 0).all() and (block_expert < e).all()


def test_route_align_strided_logits_and_one_expert():
    """Logits as a strided view (a column slice of a wider output); every token on one expert."""
    from pageflash.kernels.fused_moe import route_align

    wide = torch.full((9, 20), -5.0)
    wide[:, 3] = 4.0
    wide[:, 7] = 1.0
    w, ids, sorted_ids, block_expert, num_rows = route_align(wide[:, :12], 2, True, 16)
    assert ids[:, 0].eq(3).all() and ids[:, 1].eq(7).all()
    assert int(num_rows) == 32
    assert sorted_ids[:16].tolist() == list(range(0, 18, 2)) + [18] * 7
    assert sorted_ids[16:32].tolist() == list(range(1, 18, 2)) + [18] * 7
    assert block_expert[:2].tolist() == [3, 7]


@pytest.mark.parametrize("t,e,k,renorm", [(1, 8, 2, True), (6, 5, 2, False), (37, 4, 3, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_routed_moe_equals_route_and_reference(t, e, k, renorm, dtype):
    from pageflash.kernels.fused_moe import route_align_fits, routed_moe
    from pageflash.layers.moe import route

    x, w13, w2, _, _ = make_inputs(t, 48, 40, e, k, dtype, seed=t)
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(5)).to(dtype)
    assert route_align_fits(t, e, k)
    out = routed_moe(x, logits, w13, w2, k, renorm)
    w, ids = route(logits, k, renorm)
    assert rel_err(out, fused_moe_ref(x, w13, w2, w, ids)) < TOL[dtype]


def test_routed_moe_beyond_route_align(monkeypatch):
    """Routings route_align does not cover take route() + moe_align() (same result); a top_k outside
    [1, E] is refused."""
    import pageflash.kernels.fused_moe as fm
    from pageflash.layers.moe import route

    x, w13, w2, _, _ = make_inputs(20, 48, 40, 8, 2, torch.float32, seed=3)
    logits = torch.randn(20, 8, generator=torch.Generator().manual_seed(6))
    monkeypatch.setattr(fm, "route_align_fits", lambda t, e, k: False)
    out = fm.routed_moe(x, logits, w13, w2, 2, True)
    w, ids = route(logits, 2, True)
    assert rel_err(out, fused_moe_ref(x, w13, w2, w, ids)) < TOL[torch.float32]
    with pytest.raises(ValueError, match="top_k"):
        fm.routed_moe(x, logits, w13, w2, 9, True)


# ------------------------------------------------------------------------------ INT8 / FP8 experts


@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (19, 8, 3), (40, 4, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_experts_equal_the_dequantized_reference(t, e, k, dtype, method):
    """Codes (int8 or e4m3) widened in registers and the per-row scales applied to the products equal
    the reference over the dequantized weights (both GEMMs; the gated one scales gate and up rows
    separately)."""
    from pageflash.kernels.fused_moe import routed_moe
    from pageflash.layers.linear import quantize_weight
    from pageflash.layers.moe import route

    x, w13, w2, _, _ = make_inputs(t, 48, 40, e, k, dtype, seed=t + 7)
    q13, s13 = quantize_weight(w13.reshape(-1, 48), method)
    q2, s2 = quantize_weight(w2.reshape(-1, 40), method)
    q13, s13, q2, s2 = q13.view(w13.shape), s13.view(e, 80), q2.view(w2.shape), s2.view(e, 48)
    s13[1] *= 3.0  # scales that differ per expert and per row (gate vs up) matter
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(2)).to(dtype)
    w, ids = route(logits, k, True)
    want = fused_moe_ref(x, q13, q2, w, ids, s13, s2)
    assert rel_err(fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2), want) < TOL[dtype]
    assert rel_err(routed_moe(x, logits, q13, q2, k, True, w13_scale=s13, w2_scale=s2), want) < TOL[dtype]
    with pytest.raises(ValueError, match="both"):
        fused_moe(x, q13, q2, w, ids, w13_scale=s13)
    with pytest.raises(ValueError, match="int8 codes"):
        fused_moe(x, w13, w2, w, ids, w13_scale=s13, w2_scale=s2)
    with pytest.raises(ValueError, match="w2_scale"):
        fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2[:, :5].contiguous())


@pytest.mark.parametrize("t,e,k", [(1, 4, 2), (19, 8, 3), (40, 4, 1), (60, 2, 2), (130, 2, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a8_experts_equal_the_w8a8_reference(t, e, k, dtype):
    """W8A8 e4m3 experts (x's rows and the SiLU's output rows quantized per row, e4m3 x e4m3 dots, both
    scales on the products) against experts_ref(w8a8=True), through fused_moe and routed_moe; the
    automatic choice keeps CPU and 16-bit x weight-only; w8a8 over int8 codes is refused. The token
    counts reach each of _config(fp8=True)'s row tiles (16, 32, 64, 128 rows an expert)."""
    from pageflash.kernels.fused_moe import routed_moe, w8a8_applies
    from pageflash.layers.linear import quantize_weight
    from pageflash.layers.moe import route

    x, w13, w2, _, _ = make_inputs(t, 64, 48, e, k, dtype, seed=t + 9)
    x[0, :5] *= 40.0  # a row whose scale follows its own largest value
    q13, s13 = quantize_weight(w13.reshape(-1, 64), "fp8")
    q2, s2 = quantize_weight(w2.reshape(-1, 48), "fp8")
    q13, s13, q2, s2 = q13.view(w13.shape), s13.view(e, 96), q2.view(w2.shape), s2.view(e, 64)
    s13[1] *= 3.0
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(3)).to(dtype)
    w, ids = route(logits, k, True)
    want = fused_moe_ref(x, q13, q2, w, ids, s13, s2, w8a8=True)
    tol = 1e-4 if dtype == torch.float32 else TOL[dtype]
    got = fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, w8a8=True)
    assert rel_err(got, want) < tol
    assert rel_err(routed_moe(x, logits, q13, q2, k, True, w13_scale=s13, w2_scale=s2, w8a8=True), want) < tol
    # W8A8 is not the weight-only product: the activation codes move it by about their rounding
    wo = fused_moe_ref(x, q13, q2, w, ids, s13, s2)
    assert 1e-4 < rel_err(want, wo) < 0.1
    assert not w8a8_applies(x.bfloat16(), q13)  # CPU
    with pytest.raises(ValueError, match="w8a8 needs e4m3"):
        qi, si = quantize_weight(w13.reshape(-1, 64), "int8")
        qi2, si2 = quantize_weight(w2.reshape(-1, 48), "int8")
        fused_moe(x, qi.view(w13.shape), qi2.view(w2.shape), w, ids, w13_scale=si.view(e, 96),
                  w2_scale=si2.view(e, 64), w8a8=True)


def test_route_align_and_routed_moe_bad_inputs_and_empty_steps():
    """A router scoring more experts than w13 holds, top_k outside [1, E] and non-2-D logits are
    refused; an empty step gives empty routing and no used rows on both launch paths."""
    import pageflash.kernels.fused_moe as fm

    x, w13, w2, _, _ = make_inputs(3, 48, 40, 4, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="score 8 experts"):
        fm.routed_moe(x, torch.randn(3, 8), w13, w2, 2, True)
    for k in (0, 7):
        with pytest.raises(ValueError, match="top_k"):
            fm.route_align(torch.randn(2, 6), k, True, 16)
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        fm.route_align(torch.randn(6), 2, True, 16)
    for fused in (True, False):
        w, ids, sorted_ids, block_expert, num_rows = fm.route_align(torch.zeros(0, 512), 2, True, 16, fused=fused)
        assert w.shape == (0, 2) and ids.shape == (0, 2) and int(num_rows) == 0
        assert sorted_ids.numel() == 0 and block_expert.numel() == 0
    assert fm.routed_moe(x[:0], torch.zeros(0, 4), w13, w2, 2, True).shape == (0, 48)
