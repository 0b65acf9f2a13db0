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


@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (1000, 576)])
@pytest.mark.parametrize("rows", [8, 32, 64])
def test_gemv_bf16(m, n, k, rows):
    from pageflash.kernels.gemv import gemv, gemv_ref

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    y = gemv(x, w, rows, 4, 512, 4, 4, out=out)
    ref = gemv_ref(x, w)
    assert not y.isnan().any()
    err = (y.float() - ref.float()).norm() / ref.float().norm()
    assert err < 1e-2


def test_dispatch_times_gemv_at_one_row():
    """At M = 1 the dispatch times the GEMV and cuBLAS, on every shape (gate_up's weight is past the
    skinny kernel's size limit); whatever it picks matches cuBLAS."""
    d = SkinnyDispatch()
    for n, k in ((28672, 4096), (4096, 4096)):
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        y = d(x, w)
        c = d.choice[(n, k, 1, torch.bfloat16)]
        assert c is None or c[0] == "gemv"  # at one row: the GEMV or cuBLAS, never the skinny kernel
        if y is not None:
            ref = torch.nn.functional.linear(x, w)
            assert (y.float() - ref.float()).norm() / ref.float().norm() < 1e-2
    print("choice", d.choice)




@pytest.mark.parametrize("inter,k,rows", [(14336, 4096, 8), (1536, 576, 16), (100, 64, 8)])
def test_gemv_silu_mul_bf16_bitwise(inter, k, rows):
    """The GEMV with SiLU-and-mul in its epilogue writes exactly what the GEMV then the SiLU kernel
    write (bf16, llama-3-8b's and smollm2's MLP shapes, a ragged I), and the dispatch's own decision
    for the fused path (the fused GEMV against cuBLAS + the SiLU kernel) returns what it chose."""
    from pageflash.kernels.activation import silu_and_mul
    from pageflash.kernels.gemv import gemv

    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2 * inter, k, device="cuda", dtype=torch.bfloat16) * 0.02
    y = gemv(x, w, rows, 4, 512, 4, 4, silu_mul=True)
    assert torch.equal(y, silu_and_mul(gemv(x, w, rows, 4, 512, 4, 4)))
    d = SkinnyDispatch()
    fused = d.gate_up_silu(x, w)
    c = d.choice[(2 * inter, k, 1, torch.bfloat16, "silu")]
    if c is not None:
        assert c[0] == "gemv" and c[1][0] % (2 * c[1][1]) == 0
        assert torch.equal(fused, silu_and_mul(gemv(x, w, *c[1])))
    else:
        assert fused is None
    assert (2 * inter, k, 1, torch.bfloat16) not in d.choice  # the plain product is decided apart
    # GeGLU (Gemma): bitwise the GEMV then the GELU kernel
    from pageflash.kernels.activation import gelu_tanh_and_mul

    y = gemv(x, w, rows, 4, 512, 4, 4, silu_mul=True, act="gelu_pytorch_tanh")
    assert torch.equal(y, gelu_tanh_and_mul(gemv(x, w, rows, 4, 512, 4, 4)))
