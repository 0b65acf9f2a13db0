"""The wrappers' integer helpers equal Triton's next_power_of_2 / cdiv."""

import triton

from pageflash.kernels.host_math import cdiv, next_pow2


def test_next_pow2_matches_triton():
    for n in list(range(0, 4100)) + [2**20 - 1, 2**20, 2**20 + 1, 131072, 49152, 128256]:
        assert next_pow2(n) == triton.next_power_of_2(n), n


def test_cdiv_matches_triton():
    for a in range(0, 300):
        for b in (1, 2, 3, 7, 16, 64, 128):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
