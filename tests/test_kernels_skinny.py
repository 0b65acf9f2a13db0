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


# ---- row-streaming GEMV (kernels/gemv.py) --------------------------------------------------------
from pageflash.kernels.gemv import gemv, gemv_ref  # noqa: E402


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(48, 64), (37, 300), (8, 1000)])
@pytest.mark.parametrize("cfg", [(8, 4, 64, 2, 4), (6, 2, 128, 3, 4), (16, 16, 32, 1, 4), (3, 1, 512, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemv_matches_reference(m, n, k, cfg, dtype):
    """Ragged N (rows past N masked, a program's row count not dividing N), K not a multiple of the
    tile, several row groups per program, outputs poisoned first."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    out = torch.full((m, n), float("nan"), dtype=dtype)
    y = gemv(x, w, *cfg, out=out)
    ref = gemv_ref(x, w)
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    assert y is out and y.shape == (m, n) and y.dtype == dtype
    assert torch.allclose(y.float(), ref.float(), rtol=tol, atol=tol * k ** 0.5)


def test_gemv_strided_rows_of_x_and_w():
    """x and w as row slices of wider tensors (row strides != K)."""
    g = torch.Generator().manual_seed(7)
    xb = torch.randn(2, 100, generator=g)
    wb = torch.randn(30, 100, generator=g)
    x, w = xb[:, :64], wb[:, :64]
    y = gemv(x, w, 8, 4, 32, 2, 4)
    assert torch.allclose(y, x @ w.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,inter,k,cfg", [(1, 40, 96, (8, 4, 32, 2, 4)), (3, 36, 64, (16, 4, 32, 3, 4)),
                                          (2, 8, 50, (8, 2, 16, 1, 2))])
def test_gemv_silu_mul_equals_gemv_then_silu_and_mul(m, inter, k, cfg, dtype):
    """silu_mul=True (the SiLU-and-mul in the GEMV's epilogue) writes exactly what the plain GEMV
    followed by the SiLU kernel writes, over a ragged I (a program's features past I masked)."""
    from pageflash.kernels.activation import silu_and_mul

    g = torch.Generator().manual_seed(m * 100 + inter + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(2 * inter, k, generator=g).to(dtype)
    out = torch.full((m, inter), float("nan"), dtype=dtype)
    y = gemv(x, w, *cfg, out=out, silu_mul=True)
    assert y is out
    assert torch.equal(y, silu_and_mul(gemv(x, w, *cfg)))
    with pytest.raises(ValueError, match="silu_mul"):
        gemv(x, w, 4, 4, 32, 1, 4, silu_mul=True)  # rows not a multiple of 2 * r
    # GeGLU (Gemma): GELU's tanh form in the same epilogue, as the plain GEMV + gelu_tanh_and_mul
    from pageflash.kernels.activation import gelu_tanh_and_mul

    y = gemv(x, w, *cfg, silu_mul=True, act="gelu_pytorch_tanh")
    assert torch.equal(y, gelu_tanh_and_mul(gemv(x, w, *cfg)))
    with pytest.raises(ValueError, match="act must be"):
        gemv(x, w, *cfg, silu_mul=True, act="relu")


def test_gemv_float32_out_is_the_rounded_product_widened():
    """out float32 (the LM head's logits): bitwise gemv(...).float() -- rounded to x's dtype first."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(1, 96, generator=g).half()
    w = torch.randn(44, 96, generator=g).half()
    out = torch.full((1, 44), float("nan"))
    assert gemv(x, w, 8, 4, 32, 2, 4, out=out) is out
    assert torch.equal(out, gemv(x, w, 8, 4, 32, 2, 4).float())
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, 8, 4, 32, 2, 4, out=torch.empty(1, 44, dtype=torch.float64))
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, 8, 4, 32, 2, 4, out=torch.empty(1, 43))


def test_gemv_rejects_bad_inputs():
    with pytest.raises(ValueError, match="M <= 4"):
        gemv(torch.randn(5, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="K="):
        gemv(torch.randn(1, 8), torch.randn(4, 9))
    with pytest.raises(ValueError, match="multiple of r"):
        gemv(torch.randn(1, 8), torch.randn(4, 8), rows=6, r=4)
    with pytest.raises(ValueError, match="dtype"):
        gemv(torch.randn(1, 8), torch.randn(4, 8).half())
    with pytest.raises(ValueError, match="contiguous along K"):
        gemv(torch.randn(8, 2).t(), torch.randn(4, 8))


def test_gemv_tile_default_and_env_override(monkeypatch):
    """PAGEFLASH_GEMV_TILE ("r,bk,stages,warps") replaces the GEMV's tile for A/Bs; a malformed value
    is an error that names the variable, never a silent fallback to the default."""
    from pageflash.kernels import skinny_gemm as sg

    monkeypatch.delenv("PAGEFLASH_GEMV_TILE", raising=False)
    assert sg.gemv_tile() == sg._GEMV_TILE
    monkeypatch.setenv("PAGEFLASH_GEMV_TILE", "8, 1024, 3, 4")
    assert sg.gemv_tile() == (8, 1024, 3, 4)
    for bad in ("4,512,4", "4,512,4,4,1", "a,512,4,4", "3,512,4,4", "4,500,4,4", "4,512,0,4", "4,512,4,6",
                "-4,512,4,4"):
        monkeypatch.setenv("PAGEFLASH_GEMV_TILE", bad)
        with pytest.raises(ValueError, match="PAGEFLASH_GEMV_TILE"):
            sg.gemv_tile()


@pytest.mark.parametrize("r", [1, 2, 4, 8, 16])
def test_gemv_rows_candidates_are_multiples_of_r(r):
    """The dispatch's rows-per-program candidates: each a multiple of the tile's r (the GEMV rejects
    others), 8 first where r allows it, no repeats, and about 4 programs per SM among them."""
    from pageflash.kernels.skinny_gemm import _gemv_rows

    for n in (5, 64, 1000, 4096, 6144, 28672, 128256):
        for sms in (78, 132):
            rows = _gemv_rows(n, sms, r)
            assert rows[0] == max(8, r) and len(rows) == len(set(rows))
            assert all(v % r == 0 and v >= r for v in rows)
            assert any(-(-n // v) <= 4 * sms for v in rows)


def test_gemv_tile_by_bandwidth_per_sm(monkeypatch):
    """Without the override the tile follows the device's peak bandwidth per SM (as the decode
    kernel's stages): the H200's 36 GB/s takes the deeper tile, the H100 SXM's 25 GB/s and a device
    whose properties lack the memory clock keep run 17's."""
    from types import SimpleNamespace

    from pageflash.kernels import skinny_gemm as sg

    monkeypatch.delenv("PAGEFLASH_GEMV_TILE", raising=False)
    h200 = SimpleNamespace(memory_clock_rate=3_201_000, memory_bus_width=6144, multi_processor_count=132)
    h100 = SimpleNamespace(memory_clock_rate=2_619_000, memory_bus_width=5120, multi_processor_count=132)
    cuda = torch.device("cuda", 0)
    for props, want in ((h200, sg._GEMV_TILE_HIGH_BW), (h100, sg._GEMV_TILE),
                        (SimpleNamespace(multi_processor_count=132), sg._GEMV_TILE)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d, p=props: p)
        assert sg.gemv_tile(cuda) == want
    assert sg.gemv_tile(torch.device("cpu")) == sg._GEMV_TILE
    monkeypatch.setenv("PAGEFLASH_GEMV_TILE", "2,256,2,2")
    assert sg.gemv_tile(cuda) == (2, 256, 2, 2)


def test_fused_gate_up_candidates_hold_whole_gate_up_pairs(monkeypatch):
    """The fused gate/up GEMV's candidates (rows a multiple of 2 r: a gate and an up group a program),
    then cuBLAS, which there stands for cuBLAS + the activation kernel; the plain product's keep r."""
    from types import SimpleNamespace

    from pageflash.kernels import skinny_gemm as sg

    monkeypatch.setenv("PAGEFLASH_GEMV_TILE", "4,512,4,4")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    x, w = torch.empty(1, 4096), torch.empty(28672, 4096)
    fused = sg.SkinnyDispatch._candidates(x, w, False, silu=True)
    plain = sg.SkinnyDispatch._candidates(x, w, False)
    assert fused[-1] == ("cublas", None) and plain[-1] == ("cublas", None)
    assert all(c[1][0] % 8 == 0 and c[1][1:] == (4, 512, 4, 4) for c in fused[:-1]) and len(fused) > 2
    assert any(c[1][0] % 8 for c in plain[:-1])  # about 4 programs an SM: 56 rows, and half of it, 28
