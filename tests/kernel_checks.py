"""Shared by the CPU kernel tests: every torch.empty / empty_like (the launchers' outputs and
intermediates) starts poisoned, so that an element a kernel leaves unwritten shows up.

A test module takes it with ``from kernel_checks import poison_outputs  # noqa: F401`` (autouse)."""

import pytest
import torch


def poison(t: torch.Tensor) -> torch.Tensor:
    """NaN for floats; ints -12345 where that fits, else the type's minimum (int8: -128)."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t
    return t.fill_(-12345 if torch.iinfo(t.dtype).min <= -12345 else torch.iinfo(t.dtype).min)


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poison(empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poison(empty_like(*a, **kw)))
