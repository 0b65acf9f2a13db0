#!/usr/bin/env bash
# LoRA on the GPU, logs under $OUT (written before any GPU run: the first session with device time runs it).
#   scripts/gpu_lora.sh tests   # tests/gpu/test_lora_gpu.py (kernels at model sizes, decode graphs == eager ==
#                               # HF + peft, bf16), then the engine / kernel suites the LoRA hooks touch
#   scripts/gpu_lora.sh bench   # llama-3-8b decode at batch 1 / 16 / 64: no LoRA, LoRA slots with base
#                               # requests (on the graphs without the LoRA kernels, then with them:
#                               # PAGEFLASH_LORA_FREE_GRAPHS=0), one rank-16
#                               # adapter (shrinks on a side stream, then in line), four rank-16 adapters in turn
#   scripts/gpu_lora.sh fused   # batch 1, one rank-16 adapter: the delta in the GEMV's launch
#                               # (PAGEFLASH_LORA_GEMV=1, the default) against shrink / expand (=0),
#                               # alternating fresh processes (ROUNDS, default 2), then no LoRA once
source "$(dirname "$0")/gpu_env.sh"
for what in "$@"; do
  if [[ $what == tests ]]; then
    python3 -m pytest -q -ra -x tests/gpu/test_lora_gpu.py 2>&1 | tee "$OUT/lora_tests.log" | tail -8
    python3 -m pytest -q -ra tests/gpu/test_engine_gpu.py tests/gpu/test_skinny_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
  fi
  if [[ $what == fused ]]; then
    for round in $(seq ${ROUNDS:-2}); do
      for v in ${VARIANTS:-1 0}; do
        PAGEFLASH_LORA_GEMV=$v python3 -m pageflash.cli bench latency --model ${MODEL:-llama-3-8b} --input-len 128 \
          --output-len 256 --batch-size 1 --num-iters 2 --disable-tqdm --lora-rank 16 \
          --json "$OUT/fused$v.r$round.json" 2>&1 | tee "$OUT/fused$v.r$round.log" | grep -v "^wrote" | tail -2 | sed "s/^/gemv=$v round $round: /"
      done
    done
    python3 -m pageflash.cli bench latency --model ${MODEL:-llama-3-8b} --input-len 128 --output-len 256 --batch-size 1 \
      --num-iters 2 --disable-tqdm --json "$OUT/nolora.json" 2>&1 | tee "$OUT/nolora.log" | grep -v "^wrote" | tail -2 | sed "s/^/no LoRA: /"
  fi
  if [[ $what == bench ]]; then
    i=0
    # (the --enable-lora line twice: base-only steps on the graphs without the LoRA kernels, then with them)
    # (and the rank-16 line with the shrinks in line instead of on a side stream: PAGEFLASH_LORA_SIDE_STREAM=0)
    for flags in "" "--enable-lora" "PAGEFLASH_LORA_FREE_GRAPHS=0 --enable-lora" "--lora-rank 16" \
                 "PAGEFLASH_LORA_SIDE_STREAM=0 --lora-rank 16" "--lora-rank 16 --num-loras 4"; do
      i=$((i + 1))
      env_=""
      [[ $flags == PAGEFLASH_* ]] && env_=${flags%% *} && flags=${flags#* }
      env $env_ python3 -m pageflash.cli bench latency --model ${MODEL:-llama-3-8b} --input-len 128 --output-len 256 \
        --batch-size ${BATCHES:-1 16 64} --num-iters 2 --disable-tqdm $flags \
        --json "$OUT/lat_lora$i.json" 2>&1 | tee "$OUT/lat_lora$i.log" | tail -5
    done
  fi
done
