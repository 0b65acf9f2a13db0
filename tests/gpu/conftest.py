"""tests/gpu: CUDA tests, run on the device machine (`python -m pytest tests/gpu`).

Without CUDA they are not collected at all (rather than collected and skipped)."""

import pytest
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]


@pytest.fixture
def poison_outputs(monkeypatch):
    """torch.empty / empty_like fill with NaN (ints: -12345, or the type's minimum) while a test runs: a kernel output left
    unwritten shows up as NaN. Kernel test modules use it for every test (pytestmark)."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            return t.fill_(float("nan"))
        if t.dtype == torch.bool:
            return t
        info = torch.iinfo(t.dtype)  # -12345 where it fits; int8: -128 (never an INT8 weight code)
        return t.fill_(-12345 if info.min <= -12345 else (info.min if info.min < 0 else info.max))

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))


@pytest.fixture(autouse=True)
def _free_cuda_memory():
    """After each test: collect the engines it made (their CUDA graph pools and KV caches) and hand
    the cached blocks back, so that a later engine in the same process sizes its pool from a clean
    GPU rather than failing on memory the caching allocator still holds."""
    yield
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
