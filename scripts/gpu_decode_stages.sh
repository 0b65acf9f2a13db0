#!/usr/bin/env bash
# On the GPU machine (run 58): the decode config's stages by the GPU's bandwidth per SM. The decode GPU
# tests, an engine A/B of PAGEFLASH_DECODE_STAGES=1 (the H100 config) against the default (2 on an
# H200) alternating process by process, then `pageflash bench kernels --decode`; logs under $OUT.
#   bash scripts/gpu_decode_stages.sh [tests] [bench] [ab]   (default: all three)
source "$(dirname "$0")/gpu_env.sh"
what=${*:-tests bench ab}
python3 -c "
import torch; from pageflash.kernels import flash_decoding as fd
p = torch.cuda.get_device_properties(0); bw = fd.memory_bandwidth_per_sm(p)
print(p.name, 'peak GB/s per SM', bw and round(bw / 1e9, 1), 'decode stages', fd.decode_stages(torch.device('cuda')))
" | tee -a "$OUT/gpu.txt"
if [[ $what == *tests* ]]; then
  python3 -m pytest -q -ra -n 8 tests/gpu/test_kernels_gpu.py tests/gpu/test_engine_gpu.py \
    --deselect tests/gpu/test_engine_gpu.py::test_llama3_8b_dummy_runs_bf16 2>&1 | tee "$OUT/tests.log" | tail -4
fi
lat() {  # $1: tag, $2: PAGEFLASH_DECODE_STAGES (0: by the GPU)
  PAGEFLASH_DECODE_STAGES=$2 timeout 200 python3 -m pageflash.cli bench latency --model llama-3-8b \
    --input-len ${AB_INPUT:-2048} --output-len ${AB_OUTPUT:-64} --batch-size ${AB_BATCH:-64} --num-iters 2 \
    --disable-tqdm --json "$OUT/$1.json" 2>&1 | grep -E "^llama-3-8b|Error" | sed "s/^/$1 /"
}
if [[ $what == *bench* ]]; then
  timeout 280 python3 -m pageflash.bench.kernels --decode --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1
  grep -A8 "^W-attn-decode" "$OUT/decode.log"; grep -A6 "^quantized\|^engine\|^eager" "$OUT/decode.log" | head -30
fi
if [[ $what == *ab* ]]; then
  for i in ${AB_ROUNDS:-1 2}; do lat "s1_$i" 1; lat "auto_$i" 0; done | tee "$OUT/ab.log"
fi
