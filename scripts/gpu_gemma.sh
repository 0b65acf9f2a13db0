#!/usr/bin/env bash
# Gemma on the GPU, logs under $OUT.
#   scripts/gpu_gemma.sh tests   # tests/gpu/test_gemma_gpu.py, then the kernel / fused / window / engine GPU
#                                # suites (the kernels and the model class changed under them)
#   scripts/gpu_gemma.sh bench   # batch-1 / 16 decode of gemma-2-9b, gemma-3-4b, gemma-3-1b (dummy weights)
#                                # with HF transformers' generate on the same configs; W-decode1
source "$(dirname "$0")/gpu_env.sh"
for what in "$@"; do
  if [[ $what == tests ]]; then
    python3 -m pytest -q -ra -x -s tests/gpu/test_gemma_gpu.py 2>&1 | tee "$OUT/gemma_tests.log" | grep -v "^$" | tail -12
    python3 -m pytest -q -ra tests/gpu/test_kernels_gpu.py tests/gpu/test_fused_gpu.py tests/gpu/test_window_gpu.py \
      tests/gpu/test_engine_gpu.py tests/gpu/test_spec_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
  fi
  if [[ $what == bench ]]; then
    for m in ${MODELS:-gemma-2-9b gemma-3-4b gemma-3-1b}; do
      python3 -m pageflash.cli bench latency --model $m --input-len 128 --output-len 256 --batch-size ${BATCHES:-1 16} \
        --num-iters 2 --num-iters-warmup 1 --max-model-len 4096 --disable-tqdm \
        --json "$OUT/lat_$m.json" 2>&1 | tee "$OUT/lat_$m.log" | tail -6
      timeout 240 python3 scripts/hf_peer_decode.py $m 128 2>&1 | tee "$OUT/hf_$m.log" | tail -2
    done
    python3 -m pageflash.cli bench latency --model llama-3-8b --input-len 128 --output-len 256 --disable-tqdm \
      --json "$OUT/decode1.json" 2>&1 | tee "$OUT/decode1.log" | tail -4
  fi
done
