#!/usr/bin/env bash
# On the GPU machine: W-offline with the mixed steps' leading decodes through Flash-Decoding
# (PAGEFLASH_MIXED_DECODE=1, the default) against the paged kernel for every row (=0), for a bf16 and
# an int8 KV cache, alternating ROUNDS times; MODELS (default llama-3-8b smollm2-135m). Logs under $OUT.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
for model in ${MODELS:-llama-3-8b smollm2-135m}; do
  for i in ${ROUNDS:-1 2}; do
    for kv in auto int8; do
      for mixed in 0 1; do
        PAGEFLASH_MIXED_DECODE=$mixed python3 -m pageflash.cli bench throughput --model $model --disable-tqdm \
          --kv-cache-dtype $kv --json "$OUT/offline_${model}_${kv}_m${mixed}_$i.json" 2>&1 \
          | grep -E "^$model" | sed "s/^/mixed=$mixed kv=$kv r$i /"
      done
    done
  done
done
