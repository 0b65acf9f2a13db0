"""Integer helpers for the kernels' host-side wrappers.

Triton's ``next_power_of_2`` and ``cdiv`` are ``constexpr_function`` objects in recent Triton, and
calling one from Python costs about a microsecond and a half of wrapper code (more on a slow host);
a launch wrapper calls several per step and per layer. These are the same functions in plain Python
(tests/test_kernels_host_math.py checks them against Triton's)."""

__all__ = ["next_pow2", "cdiv"]


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0, as Triton's next_power_of_2)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers (b > 0)."""
    return (a + b - 1) // b
