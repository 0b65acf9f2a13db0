#!/usr/bin/env bash
# On the GPU machine: the kernels' CUDA tests and/or the kernel benchmark, logs under $OUT.
#   scripts/gpu_kernels.sh tests            # tests/gpu/test_kernels_gpu.py (pytest-xdist when present)
#   scripts/gpu_kernels.sh bench [ARGS...]  # python -m pageflash.bench.kernels ARGS --json $OUT/bench.json
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
what=${1:-all}
shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee -a "$OUT/gpu.txt"
git log -1 --format='commit %h %cd' 2>/dev/null | tee -a "$OUT/gpu.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  xdist=""
  $PY -c "import xdist" 2>/dev/null && xdist="-n 8"
  $PY -m pytest -q -ra $xdist tests/gpu/test_kernels_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -25 || rc=1
fi
if [[ $what == bench || $what == all ]]; then
  $PY -m pageflash.bench.kernels "$@" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || rc=1
fi
exit $rc
