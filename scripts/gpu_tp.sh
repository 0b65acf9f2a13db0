#!/usr/bin/env bash
# On the 2-GPU machine (nvidia-h200-x2): tensor parallelism, logs under $OUT.
#   scripts/gpu_tp.sh tests   # tests/gpu/test_tp_gpu.py's NCCL tests on two GPUs (9; 7 took 270 s on two H100s)
#   scripts/gpu_tp.sh shared  # its tests of two ranks sharing one GPU over gloo (any machine; 6 + 3)
#   scripts/gpu_tp.sh engine  # pageflash bench latency at 1 and 2 GPUs on the same machine, dummy weights,
#                             # MODELS (default llama-3-8b qwen3-30b-a3b), batch 1 / 16 / 64
#   scripts/gpu_tp.sh big     # llama-3.1-70b (140 GB bf16: two GPUs only), batch 1 / 16 / 64
source "$(dirname "$0")/gpu_env.sh"
what=${1:-tests}
lat() {  # model tp label
  python3 -m pageflash.cli bench latency --model $1 --load-format dummy -tp $2 --input-len ${INPUT_LEN:-128} \
    --output-len ${OUTPUT_LEN:-128} --batch-size ${BATCHES:-1 16 64} --num-iters ${ITERS:-2} --disable-tqdm \
    --max-model-len ${MAX_LEN:-4096} --json "$OUT/lat_$1_tp$2.json" ${LAT_ARGS:-} 2>&1 | tee "$OUT/lat_$1_tp$2.log" | tail -8
}
if [[ $what == tests ]]; then  # -v: which tests ran, should the command's time limit cut it off
  python3 -m pytest -ra -v tests/gpu/test_tp_gpu.py -k "gpus and not one_gpu" 2>&1 | tee "$OUT/tp_tests.log" \
    | grep -E "PASS|FAIL|ERROR|passed|failed" | tail -12
fi
if [[ $what == shared ]]; then
  python3 -m pytest -ra -v tests/gpu/test_tp_gpu.py -k "one_gpu" 2>&1 | tee "$OUT/tp_shared.log" \
    | grep -E "PASS|FAIL|ERROR|passed|failed" | tail -12
fi
if [[ $what == engine ]]; then
  for m in ${MODELS:-llama-3-8b qwen3-30b-a3b}; do
    for tp in ${TPS:-1 2}; do lat $m $tp; done
  done
fi
if [[ $what == big ]]; then
  lat llama-3.1-70b 2
fi
