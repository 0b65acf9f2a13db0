"""Which Triton kernels are specialized (compiled, with an empty TRITON_CACHE_DIR) when, during a
`pageflash bench throughput` run: every JIT cache miss with its time, and the start/end of each
LLM.generate call (the warm-up, then the timed run). Usage:
TRITON_CACHE_DIR=$(mktemp -d) python scripts/which_compiles.py --model llama-3-8b"""

import sys
import time

from triton import knobs

T0 = time.perf_counter()
events: list[tuple[float, str]] = []


def hook(*args, **kwargs):
    events.append((time.perf_counter() - T0, str(kwargs.get("repr", ""))[:220]))
    return False  # go on and compile


knobs.runtime.jit_cache_hook = hook

from pageflash import LLM  # noqa: E402
from pageflash.bench.throughput import main  # noqa: E402

marks: list[tuple[float, float]] = []
orig = LLM.generate


def generate(self, *a, **k):
    t = time.perf_counter() - T0
    try:
        return orig(self, *a, **k)
    finally:
        marks.append((t, time.perf_counter() - T0))


LLM.generate = generate
main(sys.argv[1:])
print("LLM.generate calls (start s, end s):", [(round(a, 2), round(b, 2)) for a, b in marks])
for t, r in events:
    phase = "timed" if len(marks) > 1 and t >= marks[-1][0] else "before"
    print(f"{t:8.2f} {phase:6s} {r}")
