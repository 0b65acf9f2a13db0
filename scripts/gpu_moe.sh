#!/usr/bin/env bash
# On the GPU machine: mixtures of experts (Mixtral / Qwen2-MoE / Qwen3-MoE), logs under $OUT.
#   scripts/gpu_moe.sh tests    # tests/gpu/test_moe_gpu.py, then the engine's GPU tests (the model changed)
#   scripts/gpu_moe.sh kernels  # python -m pageflash.bench.moe: the fused MoE kernels per layer shape and T
#                               # (SWEEP=1: every candidate tile config)
#   scripts/gpu_moe.sh engine   # pageflash bench latency, qwen3-30b-a3b and qwen1.5-moe-a2.7b (dummy
#                               # weights), batch 1 / 16 / 64; PEER=1 adds the expert-by-expert reference
source "$(dirname "$0")/gpu_env.sh"
what=${1:-tests}
if [[ $what == tests ]]; then
  python3 -m pytest -q -ra tests/gpu/test_moe_gpu.py 2>&1 | tee "$OUT/moe_tests.log" | tail -6
  python3 -m pytest -q -ra tests/gpu/test_engine_gpu.py 2>&1 | tee "$OUT/engine_tests.log" | tail -4
fi
if [[ $what == kernels ]]; then
  python3 -m pageflash.bench.moe ${SWEEP:+--configs} --json "$OUT/moe_probe.json" ${PROBE_ARGS:-} 2>&1 \
    | tee "$OUT/moe_probe.log" | tail -30
fi
if [[ $what == engine ]]; then
  for m in ${MODELS:-qwen3-30b-a3b qwen1.5-moe-a2.7b}; do
    python3 -m pageflash.cli bench latency --model $m --load-format dummy --input-len ${INPUT_LEN:-128} \
      --output-len ${OUTPUT_LEN:-128} --batch-size ${BATCHES:-1 16 64} --num-iters ${ITERS:-2} --disable-tqdm \
      --json "$OUT/lat_$m.json" ${LAT_ARGS:-} 2>&1 | tee "$OUT/lat_$m.log" | tail -8
  done
fi
