"""The cached-CompiledKernel launch path (pageflash/kernels/launch.py) on CUDA: launches that differ in
pointer alignment or int class get their own compiled kernel, and the fast path gives bitwise the
output of Triton's own launch path."""

from __future__ import annotations

import torch

import pageflash.kernels.flash_decoding as fd
import pageflash.kernels.rms_norm as rn
from pageflash.bench.kernels import decode_case
from pageflash.kernels.launch import FastKernel


def test_kernels_are_wrapped_and_enabled_on_cuda():
    for k in (fd._decode_split_kernel, fd._decode_combine_kernel, rn._rms_norm_kernel):
        assert isinstance(k, FastKernel) and k.enabled


def test_alignment_changes_take_their_own_kernel():
    """fp16 rows at a 2-byte offset (not 16-byte aligned) alternating with aligned ones: each call
    matches the reference; both variants end up cached."""
    torch.manual_seed(0)
    t, h = 37, 1000
    buf = torch.randn(t * h + 8, device="cuda", dtype=torch.float16)
    w = torch.randn(h, device="cuda", dtype=torch.float16)
    rn._rms_norm_kernel._cache.clear()
    for _ in range(3):
        for off in (0, 1, 8):
            x = buf[off:off + t * h].view(t, h)
            out = rn.rms_norm(x, w, 1e-6)
            ref = rn.rms_norm_ref(x, w, 1e-6)
            torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    # offsets 0 and 8 (16 bytes) share one key; offset 1 has its own (the output's alignment is the same)
    assert len(rn._rms_norm_kernel._cache) == 2


def test_fast_path_bitwise_equal_to_triton_path(monkeypatch):
    q, kc, vc, bt, sl = decode_case(3, 5000, seed=3)
    sl = torch.tensor([5000, 17, 2049], device="cuda", dtype=torch.int32)
    outs = []
    for enabled in (False, True, True):
        for k in (fd._decode_split_kernel, fd._decode_combine_kernel):
            monkeypatch.setattr(k, "enabled", enabled)
        outs.append(fd.flash_decode(q, kc, vc, bt, sl, 128 ** -0.5, num_splits=8))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    ref = fd.flash_decode_ref(q, kc, vc, bt, sl, 128 ** -0.5)
    assert (outs[2].float() - ref.float()).abs().max().item() < 2e-2
