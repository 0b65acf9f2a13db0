#!/usr/bin/env bash
# On the GPU machine (run 59): the split decode's combine as a programmatic dependent launch. The decode
# and engine GPU tests, `pageflash bench kernels --decode`, then an engine A/B of PAGEFLASH_DECODE_PDL=0
# against the default (1 on sm_90+) alternating process by process, at batch 1 (split decode); logs
# under $OUT.   bash scripts/gpu_decode_pdl.sh [tests] [bench] [ab]   (default: all three)
source "$(dirname "$0")/gpu_env.sh"
what=${*:-tests bench ab}
python3 -c "
import torch; from pageflash.kernels import flash_decoding as fd
print(torch.cuda.get_device_name(), 'decode PDL', fd.decode_pdl(torch.device('cuda')))
" | tee -a "$OUT/gpu.txt"
if [[ $what == *tests* ]]; then
  python3 -m pytest -q -ra -n 8 tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py \
    --deselect tests/gpu/test_engine_gpu.py::test_llama3_8b_dummy_runs_bf16 2>&1 | tee "$OUT/tests.log" | tail -4
fi
lat() {  # $1: tag, $2: PAGEFLASH_DECODE_PDL (unset: the default)
  env ${2:+PAGEFLASH_DECODE_PDL=$2} timeout 200 python3 -m pageflash.cli bench latency --model llama-3-8b \
    --input-len ${AB_INPUT:-7936} --output-len ${AB_OUTPUT:-128} --batch-size ${AB_BATCH:-1} --num-iters 3 \
    --disable-tqdm --json "$OUT/$1.json" 2>&1 | grep -iE "^llama-3-8b|error" | sed "s/^/$1 /"
}
if [[ $what == *bench* ]]; then
  timeout 280 python3 -m pageflash.bench.kernels --decode --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1
  grep -A8 "^W-attn-decode" "$OUT/decode.log"; grep -A6 "^quantized\|^engine\|^eager" "$OUT/decode.log" | head -30
fi
if [[ $what == *ab* ]]; then
  for i in ${AB_ROUNDS:-1 2}; do lat "off_$i" 0; lat "auto_$i" ""; done | tee "$OUT/ab.log"
fi
