#!/usr/bin/env bash
# On the GPU machine (device tool): engine tests on CUDA and the end-to-end benchmarks, logs under $OUT.
#   scripts/gpu_engine.sh [tests] [latency] [offline-small] [offline-8b] [hf-peer]
#   FLAGS="--no-async-scheduling" TAG=_sync scripts/gpu_engine.sh latency  (extra bench flags, log suffix)
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/gpu.txt"
git log -1 --format='commit %h %cd' 2>/dev/null | tee -a "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
for what in "$@"; do
  case $what in
    profile) PYTHONPATH=. $PY scripts/profile_graph.py llama-3-8b 1 2>&1 | tee "$OUT/profile.log" | tail -40 ;;
    profile-offline) PYTHONPATH=. $PY scripts/profile_offline.py llama-3-8b 256 2>&1 | tee "$OUT/profile_offline.log" | tail -12 ;;
    fused) $PY -m pytest -q -s tests/gpu/test_fused_gpu.py 2>&1 | tee "$OUT/fused_tests.log" | tail -8; $PY -m pageflash.kernels.bench_fused --tokens 1 4096 --json "$OUT/bench_fused.json" 2>&1 | tee "$OUT/bench_fused.log" | tail -14 ;;
    skinny) $PY -m pytest -q -s tests/gpu/test_skinny_gpu.py 2>&1 | tee "$OUT/skinny_tests.log" | tail -5 ;;
    profile-spec) PYTHONPATH=. $PY scripts/profile_spec.py 2>&1 | tee "$OUT/profile_spec.log" | tail -70 ;;
    tests) $PY -m pytest -q -ra -x tests/gpu/test_engine_gpu.py tests/gpu/test_spec_gpu.py 2>&1 | tee "$OUT/engine_tests.log" | tail -15 ;;
    latency) $PY -m pageflash.cli bench latency --model llama-3-8b --input-len 128 --output-len 256 $FLAGS \
               --json "$OUT/decode1$TAG.json" 2>&1 | tee "$OUT/latency$TAG.log" | grep -v "it/s" | tail -25 ;;
    latency-sweep) $PY -m pageflash.cli bench latency --model llama-3-8b --batch-size 1 8 32 64 128 \
               --output-len 128 --num-iters 2 --json "$OUT/sweep.json" --plot "$OUT/sweep.png" 2>&1 | tee "$OUT/sweep.log" | grep -v "it/s" | tail -25 ;;
    offline-small) $PY -m pageflash.cli bench throughput --model smollm2-135m $FLAGS --json "$OUT/offline_smollm$TAG.json" \
               2>&1 | tee "$OUT/offline_smollm$TAG.log" | grep -v "it/s" | tail -20 ;;
    offline-8b) $PY -m pageflash.cli bench throughput --model llama-3-8b $FLAGS --json "$OUT/offline_llama$TAG.json" \
               2>&1 | tee "$OUT/offline_llama$TAG.log" | grep -v "it/s" | tail -20 ;;
    hf-peer) PYTHONPATH=. timeout 300 $PY scripts/hf_peer_offline.py 2>&1 | tee "$OUT/hf_peer.log" | tail -10 ;;
  esac
done
