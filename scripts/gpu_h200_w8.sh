#!/usr/bin/env bash
# On the GPU machine (session 16): the INT8 / FP8 weight-only GEMV's tile for batch-1 decode.
#   bash scripts/gpu_h200_w8.sh [probe] [ab]   (no argument: both), logs under $OUT
# probe: scripts/w8_gemv_probe.py (graph chains per projection, int8 and e4m3 codes); ab: W-decode1 with
# -q int8 and -q fp8 under the default and the probe's two best configs per dtype (PAGEFLASH_W8_GEMV_CFG),
# alternating, $ROUNDS rounds (scripts/gpu_h200_decode1.sh ab), plus the variants in $EXTRA_int8 / $EXTRA_fp8
# (';'-separated, as AB_ENVS). tests: the GPU tests of the 8-bit GEMV.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
ARGS="$*"
want() { [ -z "$ARGS" ] || [[ " $ARGS " == *" $1 "* ]]; }
if want tests; then
  python3 -m pytest -q tests/gpu/test_quant_gpu.py -k "code_words or gemv or w8_linear" 2>&1 | tail -n 3
fi
if want probe; then
  timeout "${PROBE_TIMEOUT:-300}" python3 scripts/w8_gemv_probe.py "$OUT/w8_best.txt" > "$OUT/w8_probe.log" 2>&1
  grep -v "^$" "$OUT/w8_probe.log" | cut -c1-110 | tail -n 40
fi
if want ab; then
  for q in int8 fp8; do
    label=$([ $q = fp8 ] && echo e4m3 || echo int8)
    envs=default
    for c in $(awk -v l="$label" '$1 == l {print $2}' "$OUT/w8_best.txt" 2>/dev/null); do
      envs="$envs;PAGEFLASH_W8_GEMV_CFG=$c"
    done
    extra=EXTRA_$q
    [ -n "${!extra}" ] && envs="$envs;${!extra}"
    echo "-q $q: $envs"
    AB_ENVS="$envs" BENCH_ARGS="-q $q" ROUNDS=${ROUNDS:-2} bash scripts/gpu_h200_decode1.sh ab | grep -v "^NVIDIA"
  done
fi
