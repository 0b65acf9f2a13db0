"""Skinny GEMM (decode-sized x @ W^T) against its reference, under the Triton interpreter on CPU."""

import pytest
import torch

from pageflash.kernels.skinny_gemm import skinny_gemm, skinny_gemm_ref


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n,k", [(48, 64), (40, 300)])
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skinny_gemm_matches_reference(m, n, k, split_k, dtype):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    y = skinny_gemm(x, w, block_n=16, block_k=64, split_k=split_k, num_warps=4, num_stages=1)
    ref = skinny_gemm_ref(x, w)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert y.shape == (m, n) and y.dtype == dtype
    assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * k ** 0.5)


def test_skinny_gemm_rejects_bad_shapes():
    with pytest.raises(AssertionError, match="M <= 16"):
        skinny_gemm(torch.randn(17, 8), torch.randn(4, 8))
    with pytest.raises(AssertionError, match="K="):
        skinny_gemm(torch.randn(2, 8), torch.randn(4, 9))
