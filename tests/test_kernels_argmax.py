"""kernels/argmax.py (the decode graphs' greedy token) against torch.argmax, under the interpreter."""

import pytest
import torch

from pageflash.kernels.argmax import argmax, argmax_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("b,v,block", [(1, 1000, 32), (3, 4099, 64), (2, 7, 32), (4, 64 * 32 + 1, 32)])
def test_argmax_matches_torch(b, v, block, dtype):
    g = torch.Generator().manual_seed(b * 7 + v)
    x = torch.randn(b, v, generator=g).to(dtype)
    out = torch.full((b,), -5, dtype=torch.int64)
    assert argmax(x, out=out, block=block) is out
    assert torch.equal(out, argmax_ref(x))


def test_argmax_ties_nan_and_inf():
    """Ties inside a chunk and across chunk borders (first index wins), NaN (the first NaN wins, as
    in torch), rows of -inf (index 0), a row whose maximum is its last element."""
    v, block = 1000, 32  # 32 chunks of 32 (-> 64 chunks capped: 1000 / 32 = 32 chunks)
    x = torch.randn(6, v)
    x[0, [40, 41, 500]] = 9.0  # tie in one chunk and across chunks -> 40
    x[1, [31, 32]] = 9.0  # tie across the border of the first two chunks -> 31
    x[2, [700, 3]] = float("nan")  # the first NaN -> 3
    x[2, 5] = float("inf")
    x[3] = float("-inf")  # -> 0
    x[4, -1] = 50.0  # the last element -> 999
    x[5, :] = 1.0  # all equal -> 0
    got = argmax(x, block=block)
    assert torch.equal(got, argmax_ref(x))
    assert got.tolist() == [40, 31, 3, 0, 999, 0]


def test_argmax_rejects_bad_inputs():
    with pytest.raises(ValueError, match="\\[B, V\\]"):
        argmax(torch.randn(4))
    with pytest.raises(TypeError, match="float16/bfloat16/float32"):
        argmax(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="contiguous"):
        argmax(torch.randn(8, 2).t())
    with pytest.raises(ValueError, match="V = 0"):
        argmax(torch.randn(2, 0))
    assert argmax(torch.randn(0, 8)).shape == (0,)
