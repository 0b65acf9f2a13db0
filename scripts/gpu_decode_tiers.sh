#!/usr/bin/env bash
# On the GPU machine (run 60): decode graph tiers for short contexts. `probe`: split decode time against
# the split count for sequences far shorter than the graph's bound (scripts/decode_tiers_probe.py);
# `ab`: W-decode1-shaped `pageflash bench latency` (input 128, output 256, batches 1 4 16) at
# PAGEFLASH_DECODE_SHORT_KV=${AB_KVS:-4096 512} alternating, llama-3-8b and smollm2-135m (dummy
# weights); `tests`: the whole GPU suite less the solo 8B test. Logs under $OUT.
#   bash scripts/gpu_decode_tiers.sh [probe] [ab] [tests]
source "$(dirname "$0")/gpu_env.sh"
what=${*:-probe ab}
if [[ $what == *probe* ]]; then
  PYTHONPATH=.:scripts timeout 300 python3 scripts/decode_tiers_probe.py --json "$OUT/tiers.json" 2>&1 \
    | tee "$OUT/tiers.log" | grep -v "^$" | tail -80
fi
lat() {  # $1: model, $2: tag, $3: PAGEFLASH_DECODE_SHORT_KV (unset: the default)
  env ${3:+PAGEFLASH_DECODE_SHORT_KV=$3} timeout 200 python3 -m pageflash.cli bench latency --model $1 \
    --input-len ${AB_INPUT:-128} --output-len ${AB_OUTPUT:-256} --batch-size ${AB_BATCH:-1 4 16} --num-iters 3 \
    --disable-tqdm --json "$OUT/$1_$2.json" 2>&1 | grep -iE "^$1|error|cold start" | sed "s/^/$2 /"
}
if [[ $what == *ab* ]]; then
  for m in ${AB_MODELS:-llama-3-8b smollm2-135m}; do
    for i in ${AB_ROUNDS:-1 2}; do for kv in ${AB_KVS:-4096 512}; do lat $m "kv${kv}_$i" $kv; done; done
  done | tee "$OUT/ab.log"
fi
if [[ $what == *tests* ]]; then
  python3 -m pytest -q -ra -n 8 --dist loadfile tests/gpu \
    --deselect tests/gpu/test_engine_gpu.py::test_llama3_8b_dummy_runs_bf16 2>&1 | tee "$OUT/tests.log" | tail -6
fi
