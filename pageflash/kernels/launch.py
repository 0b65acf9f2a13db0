"""A cheaper host path for launching our Triton kernels.

``kernel[grid](*args, **constexprs)`` through Triton's JIT costs ~40 us of host time per launch for a
kernel of ~40 arguments on the H100 machine's host (binding, specialization, a string cache key),
against ~12 us for launching the same compiled kernel through the ``CompiledKernel`` that call returns
(``scripts/host_overhead_probe.py``). Eager steps (prefill, mixed batches, ``bench kernels`` eager
timings) launch dozens of kernels, so that difference is host time the GPU waits for.

``fast_launch(jit_fn)`` wraps a kernel: the first launch for a given *specialization key* goes through
Triton (compiling if needed) and keeps the ``CompiledKernel`` it returns; later launches with the same
key call that kernel directly. The key is at least as fine as Triton's own specialization, so that two
calls with one key always get the same compiled kernel from Triton too:

- each tensor: its dtype and whether its address is 16-byte aligned (Triton's "divisible by 16");
- each int: int32 / int64 / uint64 range, == 1, divisible by 16 (Triton specializes some of these);
- each float: "float"; each bool and each None: its value;
- every keyword argument (the constexprs and launch options: num_warps, num_stages, ...) by value.

Runtime arguments must come positionally (keyword arguments are frozen into the key, so a keyword that
is not a constexpr or a launch option disables the fast path for that wrapper). Any other argument type,
a callable grid, Triton's interpreter (CPU), or ``PAGEFLASH_FAST_LAUNCH=0`` take Triton's own path.

``precompile()``: inside it, launches of wrapped kernels from the calling thread compile (Triton's
``warmup``, then the C launcher's build) on a thread pool instead of running. The engine runs its decode
graphs' steps and a first prefill under it before capturing the graphs, so that the ~20 compiles of a
cold start overlap (their ptxas and gcc runs are subprocesses) instead of running one after another at
each first launch (cold start 14.4-17.5 s -> 8.2-10.8 s, docs/BENCHMARKS.md run 21).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch

__all__ = ["fast_launch", "FastKernel", "spec_key", "set_fast_launch", "precompile", "precompiling"]

logger = logging.getLogger(__name__)


def _tensor_key(a: torch.Tensor):
    return (a.dtype, a.data_ptr() % 16 == 0)


def _int_key(v: int):
    # == 1, divisible by 16, fits int32, fits int64 (else uint64): at least Triton's int specialization
    n = v.bit_length()
    return (v == 1, v & 15 == 0, n < 32, n < 64)


_SPEC = {
    torch.Tensor: _tensor_key,
    torch.nn.Parameter: _tensor_key,
    int: _int_key,
    float: lambda v: float,
    bool: lambda v: v,
    type(None): lambda v: None,
}


def spec_key(args: tuple) -> tuple | None:
    """The per-argument part of the key (see the module docstring); None when an argument is of a
    type the fast path does not handle (Triton's path then)."""
    try:
        return tuple([_SPEC[type(a)](a) for a in args])
    except KeyError:
        return None


def _enabled_by_env() -> bool:
    return os.environ.get("PAGEFLASH_FAST_LAUNCH", "1") != "0"


class FastKernel:
    """``kernel[grid](*args, **kwargs)`` with a cached-``CompiledKernel`` fast path (module docstring).
    Other attributes are the wrapped kernel's."""

    def __init__(self, fn: Any, enabled: bool | None = None, device_fn: Callable[[], int] | None = None):
        self.fn = fn
        self._device = device_fn or torch.cuda.current_device  # compiled kernels are per device
        if enabled is None:
            from triton.runtime.jit import JITFunction

            enabled = isinstance(fn, JITFunction) and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
        self.enabled = self.supported = enabled and _enabled_by_env()
        self._cache: dict = {}
        if self.enabled:
            sig = inspect.signature(fn.fn)
            self._names = list(sig.parameters)
            self._defaults = {n: p.default for n, p in sig.parameters.items()
                              if p.default is not inspect.Parameter.empty}
            self._constexpr = {self._names[i] for i in fn.constexprs}
            # arguments Triton does not specialize on their value (precompile's dedupe key, below)
            self._nospec = frozenset(i for i, p in enumerate(getattr(fn, "params", ()))
                                     if getattr(p, "do_not_specialize", False))

    def __getattr__(self, name):  # arg_names, params, ... of the wrapped kernel
        return getattr(self.__dict__["fn"], name)

    def __getitem__(self, grid) -> Callable[..., Any]:
        pre = _PRECOMPILE
        if pre is not None and self.supported and threading.get_ident() == pre.owner:
            return lambda *args, **kwargs: pre.submit(self, grid, args, kwargs)
        if not self.enabled or callable(grid):
            return self.fn[grid]
        return lambda *args, **kwargs: self._launch(grid, args, kwargs)

    def _tail(self, nargs: int, kwargs: dict) -> tuple | None:
        """The arguments after the positional ones, in signature order (constexprs and defaults): fixed
        for a key. None if a runtime argument was passed by keyword (it would be frozen)."""
        tail = []
        for name in self._names[nargs:]:
            if name in kwargs:
                if name not in self._constexpr:
                    return None
                tail.append(kwargs[name])
            elif name in self._defaults:
                tail.append(self._defaults[name])
            else:
                return None  # missing: let Triton raise its own error
        return tuple(tail)

    def _launch(self, grid, args: tuple, kwargs: dict):
        spec = spec_key(args)
        if spec is None:
            return self.fn[grid](*args, **kwargs)
        key = (spec, tuple(kwargs.items()), self._device())
        try:
            hit = self._cache.get(key)
        except TypeError:  # an unhashable keyword value
            return self.fn[grid](*args, **kwargs)
        if hit is not None:
            ck, tail = hit
            grid = tuple(grid) + (1,) * (3 - len(grid))
            ck[grid](*args, *tail)
            return ck
        ck = self.fn[grid](*args, **kwargs)
        tail = self._tail(len(args), kwargs)
        if tail is None or ck is None or not hasattr(ck, "__getitem__"):
            self.enabled = self.supported = False  # unsupported call or Triton API: Triton's path from now on
        else:
            self._cache[key] = (ck, tail)
        return ck


_ALL: list[FastKernel] = []


def fast_launch(fn: Any) -> FastKernel:
    """Wrap a ``@triton.jit`` kernel launched from the host (see the module docstring)."""
    k = FastKernel(fn)
    _ALL.append(k)
    return k


def set_fast_launch(enabled: bool) -> None:
    """Turn the fast path of every wrapped kernel on (where supported) or off, e.g. for A/B timings."""
    for k in _ALL:
        k.enabled = enabled and k.supported


class _Precompiler:
    """Compiles (Triton's ``warmup``: compile, no launch) and builds each launch's C launcher on a
    thread pool; see ``precompile``."""

    def __init__(self, workers: int):
        self.owner = threading.get_ident()
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pageflash-compile")
        self.futures: list = []
        self.seen: set = set()

    def submit(self, k: FastKernel, grid, args: tuple, kwargs: dict) -> None:
        spec = spec_key(args)
        if spec is not None:
            # launches that differ only in a do_not_specialize int share Triton's kernel: queued once
            # (two threads compiling one kernel at the same time would both compile it)
            spec = tuple(v[2:] if i in k._nospec and type(a) is int else v
                         for i, (a, v) in enumerate(zip(args, spec)))
            try:
                key = (id(k), spec, tuple(kwargs.items()))
                if key in self.seen:
                    return
                self.seen.add(key)
            except TypeError:
                pass
        self.futures.append(self.pool.submit(self._job, k.fn, grid, args, kwargs))

    @staticmethod
    def _job(fn: Any, grid, args: tuple, kwargs: dict) -> None:
        ck = fn.warmup(*args, grid=grid, **kwargs)
        init = getattr(ck, "_init_handles", None)
        if init is not None:
            init()  # the launcher's C build and the module load, here rather than at the first launch

    def wait(self) -> tuple[int, int]:
        failed = 0
        for f in self.futures:
            try:
                f.result()
            except Exception as e:  # a precompile that fails only costs its compile at the real launch
                failed += 1
                logger.debug("precompile failed: %s: %s", type(e).__name__, e)
        self.pool.shutdown()
        return len(self.futures), failed


_PRECOMPILE: _Precompiler | None = None


def precompiling() -> bool:
    """Whether this thread is inside ``precompile()`` (kernel launches only compile)."""
    pre = _PRECOMPILE
    return pre is not None and threading.get_ident() == pre.owner


@contextlib.contextmanager
def precompile(workers: int = min(8, os.cpu_count() or 1)) -> Iterator[None]:
    """Inside: launches of wrapped kernels from this thread compile on a thread pool instead of
    running (their outputs stay unwritten); on exit, wait for those compiles. For warming Triton's
    caches with the launches a code path will make, several compiles at once (their ptxas and C
    launcher builds are subprocesses, their MLIR work is C++), instead of one at a time at each first
    launch. Run only code whose host side does not depend on kernel outputs."""
    global _PRECOMPILE
    if _PRECOMPILE is not None:
        raise RuntimeError("precompile() is already active")
    pre = _PRECOMPILE = _Precompiler(workers)
    try:
        yield
    finally:
        _PRECOMPILE = None
        n, failed = pre.wait()
        logger.info("precompiled %d kernel launches (%d failed)", n, failed)
