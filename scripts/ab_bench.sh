#!/usr/bin/env bash
# On the GPU machine: W-decode1 (3 rounds) and W-offline smollm2-135m (2 rounds), alternating between
# the working tree and an older tree in BASE, in one session (the device's clocks drift between
# sessions more than the effects measured). Prepare BASE here and name it in `carry`:
#   mkdir -p .carry/base && git archive <commit> | tar -x -C .carry/base
#   scripts/ab_bench.sh .carry/base      # rows: new1 base1 new2 ...; JSON per run under $OUT
set -o pipefail
BASE=${1:-.carry/base}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# LAT_ARGS: other latency arguments (default W-decode1's), e.g. LAT_ARGS="--input-len 16000 --output-len 128"
LAT_ARGS=${LAT_ARGS:---input-len 128 --output-len 256}
lat() { (cd "$1" && $PY -m pageflash.cli bench latency --model llama-3-8b $LAT_ARGS \
          --disable-tqdm --json "$OUT/$2.json" 2>&1 | grep "^llama-3-8b" | sed "s/^/$2 /"); }
off() { (cd "$1" && $PY -m pageflash.cli bench throughput --model smollm2-135m --disable-tqdm \
          --json "$OUT/$2.json" 2>&1 | grep "^smollm2" | sed "s/^/$2 /"); }
for i in $(seq 1 ${LAT_ROUNDS:-3}); do lat . "new$i"; lat "$BASE" "base$i"; done
for i in $(seq 1 ${OFF_ROUNDS:-2}); do off . "off_new$i"; off "$BASE" "off_base$i"; done
