"""Integer settings read from the environment (PAGEFLASH_*), with a clear error for a bad value."""

from __future__ import annotations

import os
from typing import Optional


def int_env(name: str, default: int, minimum: int = 0) -> int:
    """os.environ[name] as an int >= minimum, or default when unset or empty; ValueError naming the
    variable otherwise."""
    v = os.environ.get(name, "")
    if v == "":
        return default
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}") from None
    if n < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return n


def int_tuple_env(name: str, default: Optional[tuple[int, ...]], pow2: tuple[bool, ...]) -> Optional[tuple[int, ...]]:
    """os.environ[name] as len(pow2) comma-separated integers >= 1 (where pow2[i], a power of two), or
    default when unset or empty; ValueError naming the variable otherwise (a kernel's tile config)."""
    v = os.environ.get(name, "")
    if v == "":
        return default
    try:
        vals = tuple(int(p) for p in v.split(","))
    except ValueError:
        vals = ()
    if len(vals) != len(pow2) or any(n < 1 or (p and n & (n - 1)) for n, p in zip(vals, pow2)):
        shape = ",".join("2^k" if p else "n" for p in pow2)
        raise ValueError(f"{name} must be {len(pow2)} comma-separated integers >= 1 ({shape}: 2^k a power of "
                         f"two), got {v!r}")
    return vals
