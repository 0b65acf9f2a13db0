# Sourced by scripts/gpu_*.sh on the device machine: logs under $OUT, unbuffered Python on this tree, and
# the GPU's name and clocks appended to $OUT/gpu.txt.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/gpu.txt"
