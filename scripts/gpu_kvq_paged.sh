#!/usr/bin/env bash
# Run 50 (one H100): the paged kernel's e4m3 codes through float16. GPU tests of the quantized cache and
# the paged kernels, scripts/kvq_paged_f16_probe.py, then W-offline llama-3-8b with --kv-cache-dtype fp8,
# this tree and .carry/base (the decode change only) alternating.
source "$(dirname "$0")/gpu_env.sh"
OUT=$(realpath "$OUT")
timeout 200 python3 -m pytest -q -ra tests/gpu/test_kv_quant_gpu.py tests/gpu/test_kernels_gpu.py -k "quant or paged" \
  > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -2 $OUT/tests.log
timeout 200 python3 scripts/kvq_paged_f16_probe.py > $OUT/paged.log 2>&1; echo "probe rc=$?"; tail -4 $OUT/paged.log
for i in ${ROUNDS:-1}; do
  for d in . .carry/base; do
    (cd $d && timeout 120 python3 -m pageflash.cli bench throughput --model llama-3-8b --load-format dummy \
      --disable-tqdm --kv-cache-dtype fp8 --json $OUT/offline_$i.json 2>&1 | grep "^llama" | sed "s|^|$d $i |")
  done
done
