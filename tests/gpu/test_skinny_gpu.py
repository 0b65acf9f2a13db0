import pytest
import torch

from pageflash.kernels.skinny_gemm import SkinnyDispatch, skinny_gemm, skinny_gemm_ref


@pytest.mark.parametrize("m", [1, 2, 8, 16])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
@pytest.mark.parametrize("cfg", [(16, 256, 1, 4, 4), (16, 256, 4, 4, 4)])
def test_skinny_bf16(m, n, k, cfg):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    y = skinny_gemm(x, w, *cfg)
    ref = skinny_gemm_ref(x, w)
    err = (y.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2


def test_dispatch_decides_and_matches():
    d = SkinnyDispatch()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    y = d(x, w)
    ref = torch.nn.functional.linear(x, w)
    if y is not None:
        assert (y.float() - ref.float()).norm() / ref.float().norm() < 1e-2
    print("choice", d.choice)
