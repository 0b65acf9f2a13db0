#!/usr/bin/env bash
# Run 49 (nvidia-h100-x2): rank 0's GPU timeline at batch 64, narrowed vs full-width block-table copy.
source "$(dirname "$0")/gpu_env.sh"
for mode in ${MODES:-used full}; do
  echo "== PAGEFLASH_DECODE_BT_COPY=$mode"
  PAGEFLASH_DECODE_BT_COPY=$mode timeout ${LIMIT:-200} python3 scripts/tp_step_profile.py "$OUT/trace_$mode" 2 64 \
    > "$OUT/prof_$mode.log" 2>&1; echo "rc=$?"
  grep -v "^\[" "$OUT/prof_$mode.log" | grep -A60 "step ms" | head -75
  gzip -f "$OUT/trace_$mode.json" 2>/dev/null
done
