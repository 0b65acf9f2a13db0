#!/usr/bin/env bash
# On the GPU machine (run 51): the paged kernel's GPU tests, then the engine with this tree and with
# .carry/base (a `git archive` of the base commit's pageflash/) alternating, logs under $OUT.
#   scripts/gpu_paged_ab.sh [tests] [ttft] [offline]
#   tests:   paged / backend kernel tests, quantized-cache and window tests, the engine's Triton == torch
#   ttft:    llama-3.1-8b (dummy) batch 1, a 16000-token prompt (two 8192-token chunks: the second attends
#            through the paged kernel), ROUNDS rounds
#   offline: W-offline llama-3-8b (mixed steps: prefill chunks through the paged kernel), one round each
source scripts/gpu_env.sh
ROUNDS=${ROUNDS:-2}
rc=0
run_tree() {  # TREE NAME CMD...
  local tree=$1 name=$2; shift 2
  local dir=$PWD; [ "$tree" = base ] && dir=$PWD/.carry/base
  (cd "$dir" && PYTHONPATH=$dir "$@" --disable-tqdm --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" \
     | grep -E "^(llama|smollm)|Throughput" | sed "s/^/$name: /") || rc=1
}
for step in "$@"; do
  case $step in
    tests)
      python -m pytest -q -ra --durations=6 tests/gpu/test_kernels_gpu.py -k "paged or backend" \
        tests/gpu/test_kv_quant_gpu.py tests/gpu/test_window_gpu.py tests/gpu/test_engine_gpu.py \
        2>&1 | tee "$OUT/tests.log" | tail -14 || rc=1 ;;
    ttft)
      for r in $(seq "$ROUNDS"); do for tree in new base; do
        run_tree $tree "ttft_${tree}_$r" python -m pageflash.cli bench latency --model llama-3.1-8b \
          --input-len 16000 --output-len 16 --batch-size 1 --num-iters 3
      done; done ;;
    offline)
      for tree in new base; do
        run_tree $tree "off_$tree" python -m pageflash.cli bench throughput --model llama-3-8b
      done ;;
  esac
done
exit $rc
