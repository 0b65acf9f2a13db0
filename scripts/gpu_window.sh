#!/usr/bin/env bash
# Sliding-window attention on the GPU, logs under $OUT.
#   scripts/gpu_window.sh tests   # tests/gpu/test_window_gpu.py, then the attention kernels' and the
#                                 # engine's GPU tests (the kernels changed under them)
#   scripts/gpu_window.sh bench   # scripts/window_probe.py; mistral-7b-v0.1 (window 4096) vs mistral-7b
#                                 # (no window, same shapes) at a 16k context, batch 1 / 16; W-decode1
source "$(dirname "$0")/gpu_env.sh"
for what in "$@"; do
  if [[ $what == tests ]]; then
    python3 -m pytest -q -ra -x tests/gpu/test_window_gpu.py 2>&1 | tee "$OUT/window_tests.log" | tail -6
    python3 -m pytest -q -ra tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_spec_gpu.py \
      tests/gpu/test_kv_quant_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
  fi
  if [[ $what == bench ]]; then
    python3 scripts/window_probe.py 2>&1 | tee "$OUT/window_probe.log" | tail -12
    for m in mistral-7b-v0.1 mistral-7b; do
      python3 -m pageflash.cli bench latency --model $m --input-len ${INPUT_LEN:-16000} --output-len 64 \
        --batch-size ${BATCHES:-1 16} --num-iters 2 --num-iters-warmup 1 --max-model-len 16384 --disable-tqdm \
        --json "$OUT/lat_$m.json" 2>&1 | tee "$OUT/lat_$m.log" | tail -6
    done
    python3 -m pageflash.cli bench latency --model llama-3-8b --input-len 128 --output-len 256 --disable-tqdm \
      --json "$OUT/decode1.json" 2>&1 | tee "$OUT/decode1.log" | tail -4
  fi
done
