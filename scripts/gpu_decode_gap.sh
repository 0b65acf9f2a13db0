#!/usr/bin/env bash
# On the GPU machine, logs under $OUT:
#   scripts/gpu_decode_gap.sh [gap] [stalls [SHAPE]]
#   gap:    scripts/decode_gap_probe.py timings, then ncu sections of ours / cudnn / stream at two shapes
#   stalls: warp-state metrics (ncu raw WarpStateStats / SchedulerStats) of ours and cudnn at SHAPE
#           (default 1x32768)
#   bytes:  DRAM bytes read, L2 hit rate and duration (ncu raw metrics, caches flushed) of ours over
#           shuffled pages, ours over pages in order, cudnn and a plain read, at B256 L1k and B1 L32k
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
OUT=${OUT:-out}
mkdir -p "$OUT"
ncu_run() {  # NAME SHAPE LOG NCU-ARGS...
  local n=$1 s=$2 log=$3; shift 3
  ncu --profile-from-start off --clock-control none "$@" python3 scripts/decode_gap_probe.py --ncu $n $s > "$log" 2>&1
  echo "== $n $s"
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
[[ $# -eq 0 ]] && set -- gap
while [[ $# -gt 0 ]]; do
  case $1 in
    gap)
      python3 scripts/decode_gap_probe.py 2>&1 | tee $OUT/gap.log | tail -9
      for s in 1x32768 64x2048; do for n in ours cudnn stream; do
        ncu_run $n $s $OUT/ncu_${n}_$s.txt --section SpeedOfLight --section Occupancy --section LaunchStats \
          --section WarpStateStats --section MemoryWorkloadAnalysis
        grep -E "^  [a-zA-Z_]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Shared Memory Config|Dynamic Shared|Block Limit|Grid Size|Warp Cycles Per Issued|L2 Hit|Waves Per SM|Mem Busy|Max Bandwidth" \
          $OUT/ncu_${n}_$s.txt | head -60
      done; done ;;
    stalls)
      s=1x32768
      [[ ${2:-} =~ ^[0-9]+x[0-9]+$ ]] && { s=$2; shift; }
      for n in ours cudnn; do
        ncu_run $n $s $OUT/stalls_${n}_$s.txt --section WarpStateStats --section SchedulerStats --page raw
        grep -E "^  [a-zA-Z_].*\(|issue_stalled.*per_warp_active|issue_active.avg.pct|warps_active.avg.per_cycle" \
          $OUT/stalls_${n}_$s.txt | awk '$NF+0 >= 0.05 || /\(/' | head -60
      done ;;
    bytes)
      for s in 256x1024 1x32768; do for n in ours order cudnn stream; do
        ncu_run $n $s $OUT/bytes_${n}_$s.txt --metrics \
          gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum
        grep -E "^  [a-zA-Z_]|gpu__time|dram__|lts__" $OUT/bytes_${n}_$s.txt | head -30
      done; done ;;
  esac
  shift
done
