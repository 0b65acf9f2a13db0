#!/usr/bin/env bash
# On the GPU machine (device tool): FP8 weights (quantization="fp8"), logs under $OUT.
#   scripts/gpu_fp8.sh [tests] [probe] [latency] [offline] [fusedab] [fusedoff] [moe] [moeab] [accab]
# tests: the FP8 GPU tests with the INT8 / MoE ones they share kernels with; probe: scripts/fp8_probe.py
# (per projection, bf16 / int8 / fp8 weight-only / W8A8); latency: llama-3-8b batch 1 / 16 / 64 for
# bf16, int8, fp8 in one call; offline: W-offline llama-3-8b, bf16 then fp8; fusedab: llama-3-8b fp8
# latency at batch 4 / 16 / 64, the activation codes from the norms' / SiLU's launches
# (PAGEFLASH_FP8_FUSED_QUANT=1) and from their own (=0), alternating, ROUNDS (2) rounds; fusedoff:
# W-offline fp8, the same A/B; moe: the MoE block at qwen3-30b-a3b / mixtral shapes per token count, bf16,
# int8, fp8 weight-only and fp8 W8A8 (python -m pageflash.bench.moe); moeab: qwen3-30b-a3b -q fp8 latency
# at batch 1 / 16 / 64 (and, with MOEAB_OFF=1, throughput over 128 prompts), W8A8 experts (PAGEFLASH_FP8_MOE_W8A8=1) then
# weight-only (=0); accab: llama-3-8b fp8 latency at batch 16 / 64 with fp8_mm's float32 sums
# (PAGEFLASH_FP8_FAST_ACCUM=0) and the tensor cores' FP8 accumulation (=1), alternating, ROUNDS rounds.
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/gpu.txt"
for what in "$@"; do
  case $what in
    tests) $PY -m pytest -q -ra -p no:cacheprovider tests/gpu/test_fp8_gpu.py tests/gpu/test_quant_gpu.py \
             tests/gpu/test_moe_gpu.py 2>&1 | tee "$OUT/fp8_tests.log" | tail -15 ;;
    probe) PYTHONPATH=. $PY scripts/fp8_probe.py "$OUT/fp8_probe.json" 2>&1 | tee "$OUT/fp8_probe.log" | tail -22 ;;
    latency) for q in none int8 fp8; do
               qa=$([ $q = none ] || echo "-q $q")
               $PY -m pageflash.cli bench latency --model llama-3-8b --input-len 128 --output-len 128 \
                 --batch-size 1 16 64 --num-iters 2 $qa --json "$OUT/lat_$q.json" 2>&1 \
                 | tee "$OUT/lat_$q.log" | grep -v "it/s" | tail -6
             done ;;
    offline) for q in none fp8; do
               qa=$([ $q = none ] || echo "-q $q")
               $PY -m pageflash.cli bench throughput --model llama-3-8b $qa --json "$OUT/offline_$q.json" 2>&1 \
                 | tee "$OUT/offline_$q.log" | grep -v "it/s" | tail -5
             done ;;
    fusedab) for i in $(seq 1 ${ROUNDS:-2}); do for f in 1 0; do
               PAGEFLASH_FP8_FUSED_QUANT=$f $PY -m pageflash.cli bench latency --model llama-3-8b --input-len 128 \
                 --output-len 128 --batch-size 4 16 64 --num-iters 2 -q fp8 --disable-tqdm \
                 --json "$OUT/fused${f}_$i.json" 2>&1 | tee "$OUT/fused${f}_$i.log" | grep -v "it/s" | tail -5 | sed "s/^/fused=$f /"
             done; done ;;
    fusedoff) for i in $(seq 1 ${ROUNDS:-1}); do for f in 1 0; do
               PAGEFLASH_FP8_FUSED_QUANT=$f $PY -m pageflash.cli bench throughput --model llama-3-8b -q fp8 \
                 --disable-tqdm --json "$OUT/fusedoff${f}_$i.json" 2>&1 | tee "$OUT/fusedoff${f}_$i.log" \
                 | grep "^llama" | sed "s/^/fused=$f /"
             done; done ;;
    accab) for i in $(seq 1 ${ROUNDS:-1}); do for f in 0 1; do
             PAGEFLASH_FP8_FAST_ACCUM=$f $PY -m pageflash.cli bench latency --model llama-3-8b --input-len 128 \
               --output-len 128 --batch-size 16 64 --num-iters 2 -q fp8 --disable-tqdm \
               --json "$OUT/acc${f}_$i.json" 2>&1 | tee "$OUT/acc${f}_$i.log" | grep "cuda" | sed "s/^/fast=$f /"
           done; done ;;
    moe) PYTHONPATH=. $PY -m pageflash.bench.moe --shapes qwen3-30b-a3b mixtral-8x7b --quant ${MOE_QUANTS:-none int8 fp8 fp8-w8a8} \
           --tokens ${MOE_TOKENS:-1 4 16 64 256 1024 4096} --json "$OUT/moe.json" 2>&1 | tee "$OUT/moe.log" \
           | grep "^|" ;;
    moeab) for f in 1 0; do
             PAGEFLASH_FP8_MOE_W8A8=$f $PY -m pageflash.cli bench latency --model qwen3-30b-a3b --input-len 128 \
               --output-len 64 --batch-size ${MOEAB_BS:-1 16 64} --num-iters 2 -q fp8 --disable-tqdm \
               --json "$OUT/moe_lat$f.json" 2>&1 | tee "$OUT/moe_lat$f.log" | grep "cuda" | sed "s/^/w8a8=$f /"
             [ -n "$MOEAB_OFF" ] && PAGEFLASH_FP8_MOE_W8A8=$f $PY -m pageflash.cli bench throughput \
               --model qwen3-30b-a3b -q fp8 --num-prompts 128 --disable-tqdm --json "$OUT/moe_off$f.json" 2>&1 \
               | tee "$OUT/moe_off$f.log" | grep "cuda" | sed "s/^/w8a8=$f /"
           done ;;
  esac
done
