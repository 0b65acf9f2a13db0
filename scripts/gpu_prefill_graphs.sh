#!/usr/bin/env bash
# Run 66: prefill CUDA graphs (engine/model_runner.py PrefillGraphs). GPU tests, then llama-3-8b TTFT at
# a 128-token prompt (batch 1, with and without a rank-16 LoRA adapter) with the graphs on and off
# (PAGEFLASH_PREFILL_GRAPH_TOKENS=0), alternating fresh processes; then the LoRA prefill probe. Logs under $OUT.
#   scripts/gpu_prefill_graphs.sh [tests] [bench] [probe]    # ROUNDS (default 2), LENS (default "128")
source "$(dirname "$0")/gpu_env.sh"
for step in "$@"; do
  case $step in
    tests) python3 -m pytest -q -ra tests/gpu/test_prefill_graphs_gpu.py 2>&1 | tee "$OUT/pg_tests.log" | tail -15 ;;
    bench)
      lat() { env $1 python3 -m pageflash.cli bench latency --model llama-3-8b --input-len $3 --output-len 64 \
                --batch-size 1 --num-iters-warmup 2 --num-iters 5 --disable-tqdm $4 --json "$OUT/$2.json" 2>&1 \
                | tee "$OUT/$2.log" | grep "^llama-3-8b" | sed "s/^/$2 /"; }
      for L in ${LENS:-128}; do
        for i in $(seq ${ROUNDS:-2}); do
          lat PAGEFLASH_PREFILL_GRAPH_TOKENS=512 "on_L${L}_$i" $L ""
          lat PAGEFLASH_PREFILL_GRAPH_TOKENS=0 "off_L${L}_$i" $L ""
          lat PAGEFLASH_PREFILL_GRAPH_TOKENS=512 "on_lora_L${L}_$i" $L "--lora-rank 16"
          lat PAGEFLASH_PREFILL_GRAPH_TOKENS=0 "off_lora_L${L}_$i" $L "--lora-rank 16"
        done
      done ;;
    probe) python3 scripts/lora_prefill_probe.py --tokens 128 512 2>&1 | grep -v Warn | tee "$OUT/probe.log" | tail -8 ;;
  esac
done
exit 0
