#!/usr/bin/env bash
# On the GPU machine: INT8 GPU tests, the kernel probe (scripts/w8_probe.py), then llama-3-8b bf16 vs
# int8 latency at batch 1 / 16 / 64 (W-decode1 at batch 1), alternating, and W-offline 8B once each;
# logs under $OUT. PROBE=0 / OFFLINE=0 skip those parts.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
python3 -m pytest -q -ra tests/gpu/test_quant_gpu.py 2>&1 | tee "$OUT/quant_tests.log" | tail -4
[ "${PROBE:-1}" = 1 ] && python3 scripts/w8_probe.py "$OUT/w8_probe.json" > "$OUT/w8_probe.log" 2>&1
lat() { python3 -m pageflash.cli bench latency --model llama-3-8b --input-len 128 --output-len 256 \
          --batch-size ${BATCHES:-1 16 64} --disable-tqdm --json "$OUT/$1.json" "${@:2}" 2>&1 \
          | grep -E "^llama-3-8b|cold start" | sed "s/^/$1 /"; }
for i in ${ROUNDS:-1 2}; do lat "bf16_$i"; lat "int8_$i" -q int8; done
if [ "${OFFLINE:-1}" = 1 ]; then
  for q in "" "-q int8"; do
    python3 -m pageflash.cli bench throughput --model llama-3-8b --disable-tqdm $q 2>&1 | tail -3 | sed "s/^/offline${q:+ int8} /"
  done
fi
[ "${PROBE:-1}" = 1 ] && cat "$OUT/w8_probe.log"
