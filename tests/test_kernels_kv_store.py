"""store_kv (Triton, interpreter on CPU) against store_kv_ref."""

from __future__ import annotations

import pytest
import torch

from pageflash.kernels.kv_store import store_kv, store_kv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h,d,page", [(2, 64, 16), (3, 80, 8), (1, 96, 4)])
def test_store_kv(h, d, page, dtype):
    g = torch.Generator().manual_seed(h * d)
    nblocks, t = 6, 9
    k = torch.randn(t, h, d, generator=g).to(dtype)
    v = torch.randn(t, h, d, generator=g).to(dtype)
    slots = torch.randperm(nblocks * page, generator=g)[:t]
    slots[[1, 5]] = -1  # padding tokens: not stored
    kc = torch.randn(nblocks, page, h, d, generator=g).to(dtype)
    vc = torch.randn(nblocks, page, h, d, generator=g).to(dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_store_kv_noncontiguous_rows_and_int32_slots():
    """k/v as slices of a fused qkv projection (row stride > H*D); int32 slot mapping."""
    qkv = torch.randn(5, 4 + 2 + 2, 32)
    k, v = qkv[:, 4:6], qkv[:, 6:8]
    kc, vc = torch.randn(3, 4, 2, 32), torch.randn(3, 4, 2, 32)
    slots = torch.tensor([0, 11, -1, 4, 7], dtype=torch.int32)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    store_kv_ref(k, v, kc_ref, vc_ref, slots.long())
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_store_kv_rejects_bad_shapes():
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(2, 4, 2, 8), torch.randn(2, 4, 2, 8),
                 torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="heads"):
        store_kv(torch.randn(3, 2, 8), torch.randn(3, 2, 8), torch.randn(2, 4, 1, 8), torch.randn(2, 4, 1, 8),
                 torch.zeros(3, dtype=torch.int64))
