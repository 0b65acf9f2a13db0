"""The cached-CompiledKernel launch path (pageflash/kernels/launch.py), against a stand-in for Triton's
JITFunction that records which path each launch took and with which arguments. (On the GPU the real
kernels run through it: tests/gpu.)"""

from __future__ import annotations

import pytest
import torch

from pageflash.kernels.launch import FastKernel, spec_key


def _kernel(X, Y, n, scale, N_PER: "tl.constexpr", FLAG: "tl.constexpr" = 0, OPT=None):  # noqa: F821
    pass


class _Compiled:
    def __init__(self, log, n):
        self.log, self.n = log, n

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("fast", self.n, grid, args))


class _Param:
    def __init__(self, nospec):
        self.do_not_specialize = nospec


class _JIT:
    """Stands in for triton's JITFunction: fn, constexprs, params, kernel[grid](...) -> a compiled
    kernel, warmup(...) -> the same without a launch. Its n is do_not_specialize."""

    def __init__(self):
        self.fn = _kernel
        self.constexprs = [4, 5]
        self.params = [_Param(i == 2) for i in range(7)]
        self.arg_names = ["X", "Y", "n", "scale", "N_PER", "FLAG", "OPT"]
        self.log = []
        self.compiled = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("slow", grid, args, kwargs))
            self.compiled += 1
            return _Compiled(self.log, self.compiled)
        return run

    def warmup(self, *args, grid, **kwargs):
        if kwargs.get("N_PER") == 0:
            raise RuntimeError("does not compile")
        self.log.append(("warmup", grid, args, kwargs))
        c = _Compiled(self.log, 0)
        c._init_handles = lambda: self.log.append(("init",))
        return c


def test_spec_key_follows_triton_specialisation():
    x = torch.zeros(64)
    assert spec_key((x,)) == spec_key((torch.ones(8),))  # dtype and alignment only, not values or shape
    assert spec_key((x[1:],)) != spec_key((x,))  # 4-byte offset: not 16-byte aligned
    assert spec_key((x[4:],)) == spec_key((x,))
    assert spec_key((x.half(),)) != spec_key((x,))
    assert spec_key((1,)) != spec_key((2,)) != spec_key((16,))  # == 1, divisible by 16
    assert spec_key((3,)) == spec_key((5,))
    assert spec_key((2**31,)) != spec_key((3,)) and spec_key((2**63,)) != spec_key((2**31,))
    assert spec_key((0.5,)) == spec_key((2.0,))
    assert spec_key((None,)) != spec_key((False,))
    assert spec_key((torch.float32,)) is None  # not handled: Triton's path


def test_fast_path_reuses_the_compiled_kernel_with_signature_order_arguments():
    jit = _JIT()
    k = FastKernel(jit, enabled=True, device_fn=lambda: 0)
    x, y = torch.zeros(32), torch.zeros(32)
    first = k[(4,)](x, y, 7, 0.5, N_PER=8, num_warps=4)
    again = k[(4, 2)](y, x, 9, 1.5, N_PER=8, num_warps=4)  # same key: fast, full argument list, grid padded
    assert again is first  # the compiled kernel, as Triton's launch returns it
    assert [e[0] for e in jit.log] == ["slow", "fast"]
    assert jit.log[1] == ("fast", 1, (4, 2, 1), (y, x, 9, 1.5, 8, 0, None))
    # a different constexpr, launch option, alignment, int class or dtype: Triton's path once, then fast
    for args, kw in [((x, y, 7, 0.5), dict(N_PER=16, num_warps=4)),
                     ((x, y, 7, 0.5), dict(N_PER=8, num_warps=8)),
                     ((x[1:], y, 7, 0.5), dict(N_PER=8, num_warps=4)),
                     ((x, y, 1, 0.5), dict(N_PER=8, num_warps=4)),
                     ((x.double(), y, 7, 0.5), dict(N_PER=8, num_warps=4))]:
        n = len(jit.log)
        k[(1,)](*args, **kw)
        k[(1,)](*args, **kw)
        assert [e[0] for e in jit.log[n:]] == ["slow", "fast"], kw
        assert jit.log[-1][1] == jit.compiled  # the kernel that key's slow launch returned
    assert jit.compiled == 6


def test_fast_path_off_for_keyword_runtime_args_callable_grids_and_odd_types():
    jit = _JIT()
    k = FastKernel(jit, enabled=True, device_fn=lambda: 0)
    x = torch.zeros(8)
    k[lambda meta: (1,)](x, x, 3, 0.5, N_PER=8)
    k[lambda meta: (1,)](x, x, 3, 0.5, N_PER=8)
    k[(1,)](x, x, 3, torch.float32, N_PER=8)  # an argument type the key does not know
    k[(1,)](x, x, 3, torch.float32, N_PER=8)
    assert all(e[0] == "slow" for e in jit.log)
    k[(1,)](x, x, n=3, scale=0.5, N_PER=8)  # a runtime argument by keyword: would be frozen -> disabled
    assert not k.enabled
    k[(1,)](x, x, 3, 0.5, N_PER=8)
    assert all(e[0] == "slow" for e in jit.log)


def test_disabled_by_env_and_passthrough_attributes(monkeypatch):
    monkeypatch.setenv("PAGEFLASH_FAST_LAUNCH", "0")
    jit = _JIT()
    k = FastKernel(jit, enabled=True, device_fn=lambda: 0)
    assert not k.enabled and k.arg_names == jit.arg_names
    x = torch.zeros(8)
    k[(1,)](x, x, 3, 0.5, N_PER=8)
    k[(1,)](x, x, 3, 0.5, N_PER=8)
    assert [e[0] for e in jit.log] == ["slow", "slow"]


def test_real_kernels_wrapped_pass_through_under_the_interpreter():
    from pageflash.kernels import flash_decoding

    k = flash_decoding._decode_split_kernel
    assert isinstance(k, FastKernel)
    if not torch.cuda.is_available():
        assert not k.enabled  # TRITON_INTERPRET=1 (tests/conftest.py): Triton's interpreter runs it
    assert "seq_len" not in k.arg_names and "SEQ_LENS" in k.arg_names


def test_precompile_compiles_on_a_pool_without_launching():
    import threading

    from pageflash.kernels import launch

    jit = _JIT()
    k = FastKernel(jit, enabled=True, device_fn=lambda: 0)
    x, y = torch.zeros(32), torch.zeros(32)
    seen_in_thread = []
    assert not launch.precompiling()
    with launch.precompile(workers=3):
        assert launch.precompiling()
        t = threading.Thread(target=lambda: seen_in_thread.append(launch.precompiling()))
        t.start()
        t.join()
        k[(4,)](x, y, 7, 0.5, N_PER=8)
        k[(2,)](y, x, 9, 1.5, N_PER=8)  # same key: queued once
        k[(2,)](y, x, 32, 1.5, N_PER=8)  # n differs only in a do_not_specialize int: queued once
        k[(4,)](x[1:], y, 7, 0.5, N_PER=8)  # misaligned: its own compile
        k[(4,)](x, y, 7, 0.5, N_PER=0)  # fails to compile: logged, not raised
        with pytest.raises(RuntimeError, match="already active"):
            with launch.precompile():
                pass
    assert seen_in_thread == [False]  # other threads launch as usual
    assert not launch.precompiling()
    kinds = [e[0] for e in jit.log]
    assert kinds.count("warmup") == 2 and kinds.count("init") == 2 and "slow" not in kinds and "fast" not in kinds
    k[(4,)](x, y, 7, 0.5, N_PER=8)  # afterwards: launches again (Triton's path first, as before)
    assert jit.log[-1][0] == "slow"


def test_wrappers_pass_runtime_arguments_positionally(monkeypatch):
    """Each host wrapper below passes its kernel's runtime arguments positionally (keywords only for
    constexprs and launch options), so that on CUDA the fast path stays on: a runtime argument by
    keyword turns it off for good (FastKernel._tail: it would freeze the value). Recorded under the
    interpreter; a kernel parameter is a constexpr when annotated so."""
    import inspect
    from pageflash.kernels import activation, gemv, rms_norm

    calls = []

    def record(module, name):
        real = getattr(module, name)

        class Recorder:
            def __getitem__(self, grid):
                def go(*args, **kwargs):
                    calls.append((real, args, kwargs))
                    return real[grid](*args, **kwargs)
                return go

        monkeypatch.setattr(module, name, Recorder())

    record(rms_norm, "_rms_norm_kernel")
    record(rms_norm, "_qk_norm_kernel")
    record(activation, "_act_and_mul_kernel")
    record(gemv, "_gemv_kernel")
    x, r, w = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    rms_norm.rms_norm(x, w, 1e-6)
    rms_norm.rms_norm(x, w, 1e-6, r, unit_offset=True, pre_weight=w.clone(), x_scale=0.5)
    rms_norm.qk_rms_norm_(torch.randn(2, 4 * 16), w[:16].clone(), w[:16].clone(), 1e-6, 2, 1, 16, unit_offset=True)
    activation.gelu_tanh_and_mul(torch.randn(2, 32))
    gemv.gemv(torch.randn(1, 32), torch.randn(16, 32), 8, 4, 32, 1, 4, silu_mul=True, act="gelu_pytorch_tanh")
    assert len(calls) == 5
    for real, args, kwargs in calls:
        fn = real.fn.fn  # (FastKernel -> Triton's function -> the Python function)
        params = inspect.signature(fn).parameters
        runtime = {n for n, p in params.items() if "constexpr" not in str(p.annotation)}
        assert not runtime & set(kwargs), (fn.__name__, sorted(runtime & set(kwargs)))
