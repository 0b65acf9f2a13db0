"""The MoE kernel probe lives in the package: `python -m pageflash.bench.moe --help` (sweeps, the
routing variants); `pageflash bench kernels --moe` runs its default table."""
import sys

from pageflash.bench.moe import main

sys.exit(main())
