#!/usr/bin/env bash
# On the GPU machine: the fused-kernel, engine and spec GPU tests, then W-decode1 (llama-3-8b batch-1
# decode) alternating the working tree and an older tree in .carry/base (3 rounds each), logs under $OUT.
#   mkdir -p .carry/base && git archive <commit> | tar -x -C .carry/base; bash scripts/gpu_session_check.sh
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pytest -q -ra tests/gpu/test_fused_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_spec_gpu.py 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -4
lat() { (cd "$1" && python3 -m pageflash.cli bench latency --model llama-3-8b --input-len 128 --output-len 256 \
          --disable-tqdm --json "$OUT/$2.json" 2>&1 | grep "^llama-3-8b" | sed "s/^/$2 /"); }
for i in 1 2 3; do lat . "new$i"; lat .carry/base "base$i"; done
