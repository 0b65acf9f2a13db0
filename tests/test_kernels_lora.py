"""LoRA shrink / expand kernels (kernels/lora_shrink.py, lora_expand.py) against their references under
the Triton interpreter: mixed slots in shuffled order, tokens without an adapter, an adapter of a
rank below the slots' (zero padding), slots with no tokens, ragged counts, split K, 1-3 slices."""

import pytest
import torch

from kernel_checks import poison_outputs  # noqa: F401
from pageflash.kernels.lora_expand import lora_expand, lora_expand_ref
from pageflash.kernels.lora_shrink import lora_shrink, lora_shrink_ref
from pageflash.lora.layers import group_by_slot


def _case(t, k, rank, slices, num_slots, dtype, seed):
    """Inputs of one targeted projection: x, stacked A / B (slot 0 zero, slot 2 of rank rank // 2
    padded with zeros), scales, and the tokens' slots (every slot but the last used, some tokens
    without an adapter)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(slices)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = torch.randn(num_slots, len(slices) * rank, k, generator=g)
    b = torch.randn(num_slots, n, rank, generator=g)
    a[0], b[0] = 0, 0
    if num_slots > 2:  # a rank-(rank // 2) adapter in slot 2: the rest of its rows / columns are padding
        h = rank // 2
        for i in range(len(slices)):
            a[2, i * rank + h: (i + 1) * rank] = 0
        b[2, :, h:] = 0
    scale = torch.rand(num_slots, len(slices), generator=g) + 0.5  # per slot and slice
    slots = torch.randint(0, max(1, num_slots - 1), (t,), generator=g, dtype=torch.int32)
    return x, a.to(dtype), b.to(dtype), scale, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,k,rank,slices,num_slots,cfg", [
    (1, 64, 8, [48], 3, None),                     # decode of one token
    (7, 100, 16, [40, 24, 24], 5, None),           # qkv-like slices, K not a multiple of the tile
    (37, 96, 8, [96, 96], 4, dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, split_k=3)),  # gate/up, split K
    (70, 64, 32, [64], 5, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, split_k=2)),  # several m-blocks per slot
    (300, 96, 8, [40, 24, 24], 3, None),           # past the decode-sized tiles (lora_shrink.DECODE_TOKENS)
])
def test_shrink_expand_match_reference(dtype, t, k, rank, slices, num_slots, cfg):
    x, a, b, scale, slots = _case(t, k, rank, slices, num_slots, dtype, seed=t * 7 + k)
    order, counts, starts = group_by_slot(slots, num_slots)
    p = lora_shrink(x, a, scale, order, counts, starts, config=cfg)
    ref_p = lora_shrink_ref(x, a, scale, order, counts, starts)
    has = slots > 0
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert p.shape[1:] == (t, len(slices) * rank)
    if cfg is not None:
        assert p.shape[0] == cfg["split_k"]
    assert torch.allclose(p.sum(0)[has], ref_p[0][has], rtol=tol, atol=tol * k ** 0.5)

    base = torch.randn(t, sum(slices), generator=torch.Generator().manual_seed(3)).to(dtype)
    out = lora_expand(p, b, order, counts, starts, base.clone(), slices)
    ref = lora_expand_ref(ref_p, b, order, counts, starts, base.clone(), slices)
    assert torch.equal(out[~has], base[~has])  # no adapter: the output is untouched
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol * (k * rank) ** 0.5)
    if has.any():
        assert not torch.allclose(out[has].float(), base[has].float(), atol=1e-3)  # the delta is there


def test_reference_is_the_lora_formula():
    """The references against the plain per-token formula out[t] += scale (x A^T) B^T, slice by slice."""
    x, a, b, scale, slots = _case(9, 32, 4, [16, 8], 4, torch.float32, seed=5)
    order, counts, starts = group_by_slot(slots, 4)
    out = lora_expand_ref(lora_shrink_ref(x, a, scale, order, counts, starts), b, order, counts, starts,
                          torch.zeros(9, 24), [16, 8])
    for i, s in enumerate(slots.tolist()):
        h = x[i] @ a[s].t()
        want = torch.cat([scale[s, 0] * h[:4] @ b[s, :16].t(), scale[s, 1] * h[4:] @ b[s, 16:].t()])
        assert torch.allclose(out[i], want, atol=1e-5)


def test_group_by_slot():
    order, counts, starts = group_by_slot(torch.tensor([2, 0, 2, 1, 0], dtype=torch.int32), 4)
    assert counts.tolist() == [2, 1, 2, 0] and starts.tolist() == [0, 2, 3, 5]
    assert order.tolist() == [1, 4, 3, 0, 2]  # stable within a slot


def test_launchers_check_shapes():
    x, a, b, scale, slots = _case(4, 32, 8, [16], 3, torch.float32, seed=1)
    meta = group_by_slot(slots, 3)
    with pytest.raises(AssertionError, match="K="):
        lora_shrink(x[:, :16], a, scale, *meta)
    p = lora_shrink(x, a, scale, *meta)
    with pytest.raises(AssertionError, match="slices"):
        lora_expand(p, b, *meta, torch.zeros(4, 16), [8])
    with pytest.raises(AssertionError, match="dtypes"):
        lora_expand(p, b, *meta, torch.zeros(4, 16, dtype=torch.float16), [16])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("slot,chunk,p_last", [(0, 16, False), (1, 16, False), (2, 16, True), (1, 1024, False),
                                               (2, 8, False), (0, 8, True)])
def test_gemv_with_lora_equals_gemv_then_shrink_expand(dtype, silu, slot, chunk, p_last):
    """kernels/gemv.py's ``lora=``: one token's product and its adapter's delta in one launch equal the
    GEMV followed by the shrink / expand references (and, for gate/up, the activation after), for an
    adapter of the slots' rank, one of half of it (zero padding) and slot 0 (no delta, bitwise the
    plain GEMV); chunks of 8 / 16 features (several, some across the slices' bounds, a last one
    short) and one of all of them; p computed first (as on the GPU) or, under the interpreter's one
    program after another, after every product (the last p program closes every chunk); the launch
    leaves its counters zero for the next."""
    from pageflash.kernels.activation import silu_and_mul
    from pageflash.kernels.gemv import GemvLoRA, gemv, gemv_lora_scratch

    slices = [64, 64] if silu else [40, 24, 24]
    x, a, b, scale, _ = _case(1, 96, 8, slices, 4, dtype, seed=slot + 10 * silu)
    w = (torch.randn(sum(slices), 96, generator=torch.Generator().manual_seed(5)) / 96 ** 0.5).to(dtype)
    slots = torch.tensor([slot], dtype=torch.int32)
    groups = group_by_slot(slots, 4)
    base = gemv(x, w, 8, 4, 32, 2, 4)
    pre = lora_expand_ref(lora_shrink_ref(x, a, scale, *groups), b, *groups, base.clone(), slices)
    ref = silu_and_mul(pre) if silu else pre
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    atol = torch.full_like(ref, tol, dtype=torch.float32)
    if silu:  # silu(g) * u: g's and u's rounding (relative to their slice's largest value, the sums'
        # scale) times the other factor, |silu'| <= 1.1 -- a small g beside a large u keeps its error
        g, u = pre.float().chunk(2, dim=-1)
        atol = atol + tol * (1.1 * u.abs() * g.abs().amax() + torch.nn.functional.silu(g).abs() * u.abs().amax())
    p, counters, gu = gemv_lora_scratch(sum(slices), len(slices), 8, silu, dtype, "cpu", chunk=chunk)
    lo = GemvLoRA(a, b, scale, slots, p, counters, gu, tuple(slices))
    y = gemv(x, w, 8, 4, 32, 2, 4, silu_mul=silu, lora=lo, lora_chunk=chunk, _lora_p_last=p_last)
    if slot == 0 and not silu:
        assert torch.equal(y, base)
    err = (y.float() - ref.float()).abs()
    assert (err <= atol + tol * ref.float().abs()).all(), err.max()
    assert not counters.any()
    with pytest.raises(ValueError, match="counters"):  # scratch sized for larger chunks
        gemv(x, w, 8, 4, 32, 2, 4, silu_mul=silu, lora=lo._replace(counters=counters[:1]), lora_chunk=8)
    with pytest.raises(ValueError, match="LoRA"):
        gemv(torch.cat([x, x]), w, 8, 4, 32, 2, 4, lora=lo)  # one row only
    with pytest.raises(ValueError, match="slices"):
        gemv(x, w, 8, 4, 32, 2, 4, lora=lo._replace(slices=(sum(slices) - 8, 8, 8)))
