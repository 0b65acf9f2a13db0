"""Integer settings read from the environment (PAGEFLASH_*), with a clear error for a bad value."""

from __future__ import annotations

import os


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
