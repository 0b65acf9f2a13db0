#!/usr/bin/env bash
# On the GPU machine: the quantized-KV-cache work (kv_cache_dtype int8 / fp8), logs under $OUT.
#   scripts/gpu_kvq.sh tests    # tests/gpu/test_kv_quant_gpu.py, then the attention kernels' and the
#                               # engine's existing GPU tests (the kernels changed under them)
#   scripts/gpu_kvq.sh kernels  # pageflash bench kernels --decode (bf16, int8 and fp8 caches)
#   scripts/gpu_kvq.sh engine   # llama-3-8b latency at a 2k-token context, B 1 / 16 / 64, auto vs int8 vs
#                               # fp8 cache (ROUNDS alternations), then W-offline 8B auto vs int8 vs fp8
source "$(dirname "$0")/gpu_env.sh"
what=${1:-tests}
if [[ $what == tests ]]; then
  xdist=""
  python3 -c "import xdist" 2>/dev/null && xdist="-n 4"
  python3 -m pytest -q -ra tests/gpu/test_kv_quant_gpu.py 2>&1 | tee "$OUT/kvq_tests.log" | tail -6
  python3 -m pytest -q -ra $xdist tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py 2>&1 \
    | tee "$OUT/kernels_engine_tests.log" | tail -6
fi
if [[ $what == kernels ]]; then
  python3 -m pageflash.bench.kernels --decode --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" \
    | sed -n '/W-attn-decode/,$p'
fi
if [[ $what == engine ]]; then
  lat() { python3 -m pageflash.cli bench latency --model llama-3-8b --input-len ${INPUT_LEN:-2048} \
            --output-len ${OUTPUT_LEN:-128} --batch-size ${BATCHES:-1 16 64} --num-iters ${ITERS:-2} --disable-tqdm \
            --json "$OUT/$1.json" "${@:2}" 2>&1 | grep -E "^llama-3-8b" | sed "s/^/$1 /"; }
  for i in ${ROUNDS:-1}; do
    lat "auto_$i"; lat "int8_$i" --kv-cache-dtype int8; lat "fp8_$i" --kv-cache-dtype fp8
  done
  if [[ ${OFFLINE:-1} == 1 ]]; then
    for kv in auto int8 fp8; do
      python3 -m pageflash.cli bench throughput --model llama-3-8b --disable-tqdm --kv-cache-dtype $kv \
        --json "$OUT/offline_$kv.json" 2>&1 | tail -3 | sed "s/^/offline $kv /"
    done
  fi
fi
