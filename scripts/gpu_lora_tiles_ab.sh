#!/usr/bin/env bash
# Run 65: LoRA decode tiles (kernels/lora_shrink.py / lora_expand.py, DECODE_TOKENS) against BASE (an
# older tree, e.g. .carry/base from `git archive`), llama-3-8b with one rank-16 adapter, alternating
# fresh processes; then no LoRA once for the ratio. Logs under $OUT.
#   scripts/gpu_lora_tiles_ab.sh [BASE] [tests]   # ROUNDS (default 2), BATCHES (default "4 16 64")
source "$(dirname "$0")/gpu_env.sh"
BASE=${1:-.carry/base}
if [[ $2 == tests ]]; then
  python3 -m pytest -q -ra -x tests/gpu/test_lora_gpu.py 2>&1 | tee "$OUT/lora_tests.log" | tail -3
fi
lat() { (cd "$1" && python3 -m pageflash.cli bench latency --model llama-3-8b --input-len 128 --output-len 256 \
          --batch-size ${BATCHES:-4 16 64} --num-iters 2 --disable-tqdm $3 --json "$OUT/$2.json" 2>&1 \
          | tee "$OUT/$2.log" | grep "^llama-3-8b" | sed "s/^/$2 /"); }
for i in $(seq ${ROUNDS:-2}); do lat . "new$i" "--lora-rank 16"; lat "$BASE" "base$i" "--lora-rank 16"; done
[[ -n $NOLORA ]] && lat . nolora ""
exit 0
