#!/usr/bin/env bash
# On the GPU machine (sessions 14-15, run 61): where W-decode1 (llama-3-8b batch-1 decode) stands on this GPU.
#   bash scripts/gpu_h200_decode1.sh [gemv] [profile] [latency] [ab]   (no argument: the first three), logs under $OUT
# gemv: scripts/gemv_probe.py (pure read vs cuBLAS / skinny / GEMV configs per projection, graph chains;
# GEMV_TILES / GEMV_PROGS widen it); profile: scripts/profile_graph.py (the decode graph kernel by kernel);
# latency: W-decode1's bench; ab: W-decode1 under each of $AB_ENVS ("default" or "VAR=v VAR2=w", separated
# by ';'), alternating, $ROUNDS rounds, on $MODEL (default llama-3-8b), $BENCH_ARGS added (e.g. "-q int8" with
# AB_ENVS="default;PAGEFLASH_W8_GEMV_CFG=8,8,1024,3,4").
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
want() { [[ " $ARGS " == *" $1 "* ]]; }
ARGS="$*"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
if [ -z "$ARGS" ] || want gemv; then
  python3 scripts/gemv_probe.py > "$OUT/gemv_probe.log" 2>&1; tail -n 60 "$OUT/gemv_probe.log" | cut -c1-90
fi
if [ -z "$ARGS" ] || want profile; then
  python3 scripts/profile_graph.py llama-3-8b 1 > "$OUT/profile_graph.log" 2>&1
  grep -A 22 "batch 1: step" "$OUT/profile_graph.log" | cut -c1-100; grep -i "GEMMs only\|copy band" "$OUT/profile_graph.log"
fi
if [ -z "$ARGS" ] || want latency; then
  python3 -m pageflash.cli bench latency --model llama-3-8b --input-len 128 --output-len 256 \
    --disable-tqdm --json "$OUT/decode1.json" > "$OUT/decode1.log" 2>&1; tail -n 6 "$OUT/decode1.log"
fi
if want ab; then
  M=${MODEL:-llama-3-8b}
  IFS=';' read -ra VARIANTS <<< "${AB_ENVS:-default}"
  for i in $(seq "${ROUNDS:-2}"); do
    for v in "${VARIANTS[@]}"; do
      if [ "$v" = default ]; then set --; else read -ra kv <<< "$v"; set -- "${kv[@]}"; fi
      env "$@" python3 -m pageflash.cli bench latency --model "$M" --input-len 128 --output-len 256 --disable-tqdm $BENCH_ARGS \
        2>&1 | grep "^$M" | awk -v t="$v" -v i="$i" '{print t " round " i ": " $7 " tok/s, step " $8 " ms, " $10 "% roofline"}'
    done
  done
  echo "  (${SECONDS}s since start)"
fi
