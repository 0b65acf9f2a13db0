"""Where a cold start's seconds go: `pageflash bench latency` (its arguments) with Triton's compiles
and ptxas runs timed, and a cProfile of the whole run (top entries by cumulative time).

Run with an empty Triton cache to see a first start:
  TRITON_CACHE_DIR=$(mktemp -d) python scripts/cold_start_profile.py --model llama-3-8b \\
      --input-len 128 --output-len 16
Prints: every compile (seconds, kernel), the totals (compile wall time, of which ptxas), then the
profile's top 40 by cumulative time.
"""

import cProfile
import io
import pstats
import subprocess
import sys
import time

import triton.compiler.compiler as tcc

compiles: list[tuple[float, float, str]] = []
ptxas: list[float] = []
T0 = time.perf_counter()
_compile = tcc.compile


def timed_compile(src, *a, **k):
    t = time.perf_counter()
    try:
        return _compile(src, *a, **k)
    finally:
        name = getattr(getattr(src, "fn", None), "__name__", None) or str(src)[:60]
        compiles.append((t - T0, time.perf_counter() - t, name))


tcc.compile = timed_compile
import triton.compiler  # noqa: E402  (JITFunction takes `compile` from the package when it first binds)

triton.compiler.compile = timed_compile
_run = subprocess.run


def timed_run(cmd, *a, **k):
    t = time.perf_counter()
    try:
        return _run(cmd, *a, **k)
    finally:
        if cmd and "ptxas" in str(cmd[0]):
            ptxas.append(time.perf_counter() - t)


subprocess.run = timed_run

from pageflash.bench.latency import main  # noqa: E402

prof = cProfile.Profile()
prof.enable()
try:
    main(sys.argv[1:])
finally:
    prof.disable()
    print(f"\n{len(compiles)} Triton compiles: {sum(c[1] for c in compiles):.2f} s in all; "
          f"ptxas {len(ptxas)} runs, {sum(ptxas):.2f} s")
    for t, d, n in compiles:
        print(f"  at {t:7.2f} s  {d:6.2f} s  {n}")
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(40)
    print(s.getvalue()[:12000])
