"""FlashAttention-2 forward/backward (Triton, interpreter on CPU) against the float32 references."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import poison_outputs  # noqa: F401  (autouse: outputs start poisoned)

from pageflash.kernels.flash_attention import (
    flash_attention,
    flash_attention_ref,
    flash_attn_varlen,
    flash_attn_varlen_fwd,
    flash_attn_varlen_ref,
)

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
GRAD_TOL = {torch.float32: 5e-5, torch.float16: 5e-3}



def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert not torch.isnan(a).any(), "NaN in output (unwritten or poisoned elements)"
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def rand(*shape, dtype, g):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "b,hq,hkv,n,d",
    [(2, 4, 1, 37, 64), (1, 8, 2, 16, 80), (1, 2, 2, 1, 32), (1, 4, 4, 33, 96)],
)
def test_forward_batched(b, hq, hkv, n, d, causal, dtype):
    g = torch.Generator().manual_seed(n * d + hq)
    q, k, v = rand(b, hq, n, d, dtype=dtype, g=g), rand(b, hkv, n, d, dtype=dtype, g=g), rand(b, hkv, n, d, dtype=dtype, g=g)
    o = flash_attention(q, k, v, causal=causal)
    ref, _ = flash_attention_ref(q, k, v, causal=causal)
    assert rel_err(o, ref) < TOL[dtype]


def test_forward_strided_view():
    """q/k/v as (B, N, H, D) tensors transposed to (B, H, N, D): no copy needed."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 21, 3, 6, 32, generator=g)  # B, N, {q,k,v}, H, D
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    o = flash_attention(q, k, v, causal=True, scale=0.2)
    ref, _ = flash_attention_ref(q, k, v, causal=True, scale=0.2)
    assert rel_err(o, ref) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_varlen_and_lse(causal, dtype):
    g = torch.Generator().manual_seed(7)
    lens = [1, 15, 17, 16, 33, 2]  # ragged, 1, block +- 1, block boundary
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t, hq, hkv, d = sum(lens), 4, 2, 64
    q, k, v = rand(t, hq, d, dtype=dtype, g=g), rand(t, hkv, d, dtype=dtype, g=g), rand(t, hkv, d, dtype=dtype, g=g)
    o, lse = flash_attn_varlen_fwd(q, k, v, cu, max(lens), causal=causal)
    ref, lse_ref = flash_attn_varlen_ref(q, k, v, cu, causal=causal)
    assert rel_err(o, ref) < TOL[dtype]
    assert rel_err(lse, lse_ref) < 1e-5


@pytest.mark.parametrize("cfg", [dict(BLOCK_M=32, BLOCK_N=16), dict(BLOCK_M=64, BLOCK_N=32)])
def test_forward_other_tiles(cfg):
    g = torch.Generator().manual_seed(2)
    lens = [50, 7, 64]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    q, k, v = (rand(sum(lens), 2, 64, dtype=torch.float32, g=g) for _ in range(3))
    o, _ = flash_attn_varlen_fwd(q, k, v, cu, max(lens), causal=True, config=dict(cfg, num_warps=4, num_stages=1))
    ref, _ = flash_attn_varlen_ref(q, k, v, cu, causal=True)
    assert rel_err(o, ref) < TOL[torch.float32]


def _grads(fn, inputs, do):
    xs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*xs)
    out.backward(do)
    return out, [x.grad for x in xs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("b,hq,hkv,n,d", [(1, 4, 2, 33, 64), (2, 2, 1, 17, 80), (1, 1, 1, 5, 32)])
def test_backward_batched(b, hq, hkv, n, d, causal, dtype):
    g = torch.Generator().manual_seed(n + d)
    q, k, v = rand(b, hq, n, d, dtype=dtype, g=g), rand(b, hkv, n, d, dtype=dtype, g=g), rand(b, hkv, n, d, dtype=dtype, g=g)
    do = rand(b, hq, n, d, dtype=dtype, g=g)
    _, got = _grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), (q, k, v), do)
    # reference gradients in float32 from the same (rounded) inputs
    _, want = _grads(lambda q, k, v: flash_attention_ref(q, k, v, causal=causal)[0], (q.float(), k.float(), v.float()),
                     do.float())
    for name, a, w in zip("qkv", got, want):
        assert a.dtype == dtype and a.shape == w.shape
        assert rel_err(a, w) < GRAD_TOL[dtype], name


def test_backward_varlen():
    g = torch.Generator().manual_seed(11)
    lens = [17, 1, 30]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    t = sum(lens)
    q, k, v = rand(t, 4, 64, dtype=torch.float32, g=g), rand(t, 1, 64, dtype=torch.float32, g=g), rand(t, 1, 64, dtype=torch.float32, g=g)
    do = rand(t, 4, 64, dtype=torch.float32, g=g)
    _, got = _grads(lambda q, k, v: flash_attn_varlen(q, k, v, cu, max(lens)), (q, k, v), do)
    _, want = _grads(lambda q, k, v: flash_attn_varlen_ref(q, k, v, cu)[0], (q, k, v), do)
    for name, a, w in zip("qkv", got, want):
        assert rel_err(a, w) < GRAD_TOL[torch.float32], name


def test_gradcheck_float64_reference_agrees():
    """The autograd Function's gradients match finite differences of the kernel itself (tiny, fp32)."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 6, 16, generator=g) for _ in range(3))
    do = torch.randn(1, 2, 6, 16, generator=g)
    _, got = _grads(lambda q, k, v: flash_attention(q, k, v, causal=True), (q, k, v), do)
    eps = 1e-2
    for gi, x in enumerate((q, k, v)):
        for idx in [(0, 0, 3, 5), (0, 1, 5, 0), (0, 1, 0, 15)]:
            xp, xm = x.clone(), x.clone()
            xp[idx] += eps
            xm[idx] -= eps
            args_p = [xp if i == gi else y for i, y in enumerate((q, k, v))]
            args_m = [xm if i == gi else y for i, y in enumerate((q, k, v))]
            fd = ((flash_attention(*args_p) - flash_attention(*args_m)) * do).sum() / (2 * eps)
            assert abs(fd.item() - got[gi][idx].item()) < 2e-3 * max(1.0, abs(fd.item()))


def test_rejects_bad_inputs():
    with pytest.raises(ValueError, match="multiple"):
        flash_attention(torch.randn(1, 3, 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16))
    with pytest.raises(TypeError, match="dtypes"):
        flash_attention(torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16).half(), torch.randn(1, 2, 4, 16))
