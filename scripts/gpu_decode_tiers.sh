#!/usr/bin/env bash
# On the GPU machine (run 60): decode graph tiers for short contexts. `probe`: split decode time against
# the split count for sequences far shorter than the graph's bound (scripts/decode_tiers_probe.py);
# `ab`: W-decode1-shaped `pageflash bench latency` (input 128, output 256, batches 1 4 16) at
# PAGEFLASH_DECODE_SHORT_KV=${AB_KVS:-4096 512} alternating, llama-3-8b and smollm2-135m (dummy
# weights); `floor`: run 60's change (a floor of 16 decode splits at short bounds, the short tier at
# 2048 keys) against the rule before it (PAGEFLASH_DECODE_SHORT_KV=4096 PAGEFLASH_DECODE_MIN_SPLITS=1),
# alternating: llama-3-8b at 2.5-3.3k keys (batch 1 2) and W-decode1 (batch 1), gemma-3-1b at 3-3.5k keys
# (its 512-key windows; batch 1 4); `tests`: the whole GPU suite less the solo 8B test; `tests-decode`:
# the kernel, engine and Gemma GPU tests. Logs under $OUT.
#   bash scripts/gpu_decode_tiers.sh [probe] [ab] [floor] [tests | tests-decode]
source "$(dirname "$0")/gpu_env.sh"
what=${*:-probe ab}
if [[ $what == *probe* ]]; then
  PYTHONPATH=.:scripts timeout 300 python3 scripts/decode_tiers_probe.py --json "$OUT/tiers.json" 2>&1 \
    | tee "$OUT/tiers.log" | grep -v "^$" | tail -80
fi
run() {  # $1: model, $2: tag, $3: input len, $4: output len, $5: batches, $6...: env assignments (none: defaults)
  local m=$1 tag=$2 il=$3 ol=$4 bs=$5; shift 5
  env "$@" timeout 200 python3 -m pageflash.cli bench latency --model $m --input-len $il --output-len $ol \
    --batch-size $bs --num-iters ${ITERS:-2} --disable-tqdm --json "/tmp/${m}_$tag.json" 2>&1 \
    | grep -iE "^$m|error" | sed "s/^/$tag /"
}
if [[ $what == *ab* ]]; then
  for m in ${AB_MODELS:-llama-3-8b smollm2-135m}; do
    for i in ${AB_ROUNDS:-1 2}; do for kv in ${AB_KVS:-4096 512}; do
      ITERS=3 run $m "kv${kv}_$i" ${AB_INPUT:-128} ${AB_OUTPUT:-256} "${AB_BATCH:-1 4 16}" PAGEFLASH_DECODE_SHORT_KV=$kv
    done; done
  done | tee "$OUT/ab.log"
fi
if [[ $what == *floor* ]]; then
  old="PAGEFLASH_DECODE_SHORT_KV=4096 PAGEFLASH_DECODE_MIN_SPLITS=1"
  for i in 1 2; do
    run llama-3-8b "long_old_$i" 2560 768 "1 2" $old; run llama-3-8b "long_new_$i" 2560 768 "1 2"
    run gemma-3-1b "old_$i" 3072 512 "1 4" $old; run gemma-3-1b "new_$i" 3072 512 "1 4"
    run llama-3-8b "d1_old_$i" 128 256 1 $old; run llama-3-8b "d1_new_$i" 128 256 1
  done | tee "$OUT/floor.log"
fi
if [[ $what == *tests-decode* ]]; then
  python3 -m pytest -q -ra -n 8 tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_gemma_gpu.py \
    --deselect tests/gpu/test_engine_gpu.py::test_llama3_8b_dummy_runs_bf16 2>&1 | tee "$OUT/tests.log" | tail -6
elif [[ $what == *tests* ]]; then
  python3 -m pytest -q -ra -n 8 --dist loadfile tests/gpu \
    --deselect tests/gpu/test_engine_gpu.py::test_llama3_8b_dummy_runs_bf16 2>&1 | tee "$OUT/tests.log" | tail -6
fi
