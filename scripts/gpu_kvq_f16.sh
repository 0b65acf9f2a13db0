#!/usr/bin/env bash
# Run 50 (one H100): e4m3 codes widened to float16 in the decode kernel, the D 64 quantized-cache config.
#   scripts/gpu_kvq_f16.sh check   # GPU tests of the quantized cache and the decode kernels, then every decode
#                                  # variant's time (scripts/decode_variants_probe.py) at 32/8x128 and 9/3x64
#   scripts/gpu_kvq_f16.sh engine  # llama-3-8b dummy latency at a 2k context with --kv-cache-dtype fp8 (and
#                                  # int8 / auto once), this tree and .carry/base alternating
source "$(dirname "$0")/gpu_env.sh"
OUT=$(realpath "$OUT")
what=${1:-check}
if [[ $what == check ]]; then
  timeout 240 python3 -m pytest -q -ra tests/gpu/test_kv_quant_gpu.py tests/gpu/test_kernels_gpu.py -k "quant or decode" \
    > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests.log
  for h in ${HEADS:-32,8,128 9,3,64}; do
    timeout 150 python3 scripts/decode_variants_probe.py $h > $OUT/variants_${h//,/_}.log 2>&1; echo "probe $h rc=$?"
    grep -E "^B|int8|e4m3" $OUT/variants_${h//,/_}.log | grep -v "rope [01] quant"
  done
fi
if [[ $what == engine ]]; then
  lat() {  # dir label args
    (cd $1 && timeout 170 python3 -m pageflash.cli bench latency --model llama-3-8b --load-format dummy \
      --input-len ${INPUT_LEN:-2048} --output-len ${OUTPUT_LEN:-64} --batch-size ${BATCHES:-1 64} --num-iters 2 \
      --disable-tqdm --json $OUT/$2.json "${@:3}" 2>&1 | grep "^llama-3-8b" | sed "s/^/$2 /")
  }
  for i in ${ROUNDS:-1 2}; do lat . new_fp8_$i --kv-cache-dtype fp8; lat .carry/base base_fp8_$i --kv-cache-dtype fp8; done
  [[ ${AUTO:-1} == 1 ]] && lat . new_auto
fi
if [[ $what == d64 ]]; then  # the 9/3x64 quantized variants under two split configs
  for c in '{"BLOCK_N": 64, "num_warps": 2, "num_stages": 3}' '{"BLOCK_N": 128, "num_warps": 4, "num_stages": 3}'; do
    echo "== QCFG $c"
    QCFG="$c" timeout 120 python3 scripts/decode_variants_probe.py 9,3,64 > $OUT/d64.log 2>&1; echo "rc=$?"
    grep -E "^B|int8|e4m3" $OUT/d64.log | grep -v "rope [01] quant"; grep "quant 1" $OUT/d64.log
  done
fi
if [[ $what == final ]]; then  # the quantized-cache GPU tests, then W-attn-decode with the int8 / fp8 rows
  timeout 250 python3 -m pytest -q -ra tests/gpu/test_kv_quant_gpu.py > $OUT/kvq_tests.log 2>&1; echo "tests rc=$?"
  tail -3 $OUT/kvq_tests.log
  timeout 300 python3 -m pageflash.cli bench kernels --decode --json $OUT/kernels.json > $OUT/kernels.log 2>&1
  echo "bench rc=$?"; sed -n '/W-attn-decode/,$p' $OUT/kernels.log | head -40
fi
