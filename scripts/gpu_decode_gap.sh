#!/usr/bin/env bash
# On the GPU machine: scripts/decode_gap_probe.py timings, then ncu sections of ours / cudnn / stream at two shapes (logs under $OUT).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
python3 scripts/decode_gap_probe.py 2>&1 | tee $OUT/gap.log | tail -9
for s in 1x32768 64x2048; do for n in ours cudnn stream; do
 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis python3 scripts/decode_gap_probe.py --ncu $n $s > $OUT/ncu_${n}_$s.txt 2>&1
 echo "== $n $s"; grep -E "^  [a-zA-Z_]|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Shared Memory Config|Dynamic Shared|Block Limit|Grid Size|Warp Cycles Per Issued|L2 Hit|Waves Per SM|Mem Busy|Max Bandwidth" $OUT/ncu_${n}_$s.txt | head -60
done; done
