#!/usr/bin/env bash
# On the GPU machine: cold start (engine + first token, empty Triton cache each run) of
# `pageflash bench latency --model llama-3-8b`, alternating the precompile modes in one session:
#   all          PAGEFLASH_PRECOMPILE=1 (decode graphs' and first prefill's kernels)
#   decode-only  the decode graphs' kernels only (_PRECOMPILE_PROMPTS emptied)
#   off          PAGEFLASH_PRECOMPILE=0
# then scripts/cold_start_profile.py with the default (which compiles are left, and when).
#   scripts/cold_start_ab.sh [ROUNDS]
set -o pipefail
export PYTHONPATH=$PWD:$PYTHONPATH PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
run() {  # MODE
  export TRITON_CACHE_DIR=$(mktemp -d)
  echo "== $1"
  PAGEFLASH_PRECOMPILE=$([[ $1 == off ]] && echo 0 || echo 1) python3 -c "
import sys, pageflash.engine.model_runner as m
if '$1' == 'decode-only': m._PRECOMPILE_PROMPTS = ()
from pageflash.cli import main
sys.exit(main(['bench', 'latency', '--model', 'llama-3-8b', '--input-len', '128', '--output-len', '32', '--disable-tqdm']))
" 2>&1 | grep -E "cold start|^llama" | cut -c1-160
}
for i in $(seq 1 ${1:-2}); do run all; run decode-only; run off; done
export TRITON_CACHE_DIR=$(mktemp -d)
python3 scripts/cold_start_profile.py --model llama-3-8b --input-len 128 --output-len 16 --disable-tqdm > "$OUT/cold.log" 2>&1
grep "cold start" "$OUT/cold.log" | cut -c1-160
sed -n '/Triton compiles/,/function calls/p' "$OUT/cold.log" | head -40
