#!/usr/bin/env bash
# On the GPU machine: warp stall reasons (ncu raw WarpStateStats metrics) of the decode split kernel
# and cuDNN's decode kernel at one shape (default B1 L32k), logs under $OUT.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
shape=${1:-1x32768}
for n in ours cudnn; do
  ncu --profile-from-start off --clock-control none --section WarpStateStats --section SchedulerStats \
      --page raw python3 scripts/decode_gap_probe.py --ncu $n $shape > $OUT/stalls_${n}_$shape.txt 2>&1
  echo "== $n $shape"
  grep -E "^  [a-zA-Z_].*\(|issue_stalled.*per_warp_active|issue_active.avg.pct|warps_active.avg.per_cycle" \
    $OUT/stalls_${n}_$shape.txt | awk '$NF+0 >= 0.05 || /\(/' | head -60
done
