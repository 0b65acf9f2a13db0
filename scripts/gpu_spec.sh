#!/usr/bin/env bash
# On the GPU machine (device tool): W-spec with the real default model, which exceeds one call's
# carry limit, so it travels in two halves across two consecutive calls (out/ is ignored by git and
# stays on the warm machine between calls):
#   split -n 2 -d SmolLM2-135M-Instruct.Q4_1.gguf .carry/gguf.       (here, once)
#   call 1 (carry .carry/gguf.00): scripts/gpu_spec.sh part0 [STEP...]
#   call 2 (carry .carry/gguf.01 and .carry/py): scripts/gpu_spec.sh part1 [STEP...]
# Steps (logs and JSON under $OUT):
#   overhead   scripts/adaptive_overhead.py at batch 64 (dummy weights), plain vs ngram+adaptive; with
#              BASE=dir also the tree in dir (e.g. .carry/base), alternating processes base/new/base/new
#   clock      scripts/clock_probe.py: plain batch-64 rounds with host speed and SM clocks per round
#   tests      tests/gpu/test_spec_gpu.py
#   b64        bench spec, ngram+adaptive at batch 64, grounded and chat, T 0 and 1 ($ITERS rounds, 5)
#   b1         bench spec at batch 1: ngram@8, ngram-tree, ngram+adaptive, grounded and chat, T 0 and 1
set -o pipefail
OUT=${OUT:-out}
mkdir -p "$OUT" out/gguf
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
MODEL=out/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
ITERS=${ITERS:-5}
# the device has no gguf package: carry its pure-Python copy in .carry/py (cp -r .venv/lib/python3*/site-packages/gguf .carry/py/)
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD/.carry/py
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/gpu.txt"
for what in "$@"; do
  case $what in
    part0) cp .carry/gguf.00 out/gguf/part0 ;;
    part1) cat out/gguf/part0 .carry/gguf.01 > "$MODEL" && sha256sum "$MODEL" | tee -a "$OUT/gpu.txt" ;;
    overhead)
      for tree in ${BASE:+$BASE} . ${BASE:+$BASE} .; do
        tag=$([ "$tree" = . ] && echo new || echo base)
        echo "== $tag ($tree)" | tee -a "$OUT/overhead.log"
        PYTHONPATH=$tree PROFILE=0 ROUNDS=${ROUNDS:-5} MODES=plain,adaptive $PY scripts/adaptive_overhead.py 2>&1 \
          | grep -v "it/s" | tail -4 | tee -a "$OUT/overhead.log"
      done ;;
    clock) PYTHONPATH=. $PY scripts/clock_probe.py 2>&1 | grep -v "it/s" | tee "$OUT/clock.log" | tail -15 ;;
    tests) $PY -m pytest -q -ra -x tests/gpu/test_spec_gpu.py 2>&1 | tee "$OUT/spec_tests.log" | tail -6 ;;
    b64) $PY -m pageflash.cli bench spec --model "$MODEL" --methods ngram+adaptive --batch-size 64 --num-prompts 256 \
           --max-tokens 128 --temperature 0 1 --num-iters "$ITERS" --json "$OUT/spec_b64$TAG.json" 2>&1 \
           | grep -v "it/s" | tee "$OUT/spec_b64$TAG.log" | tail -8 ;;
    b1) $PY -m pageflash.cli bench spec --model "$MODEL" --methods ngram@8 ngram-tree ngram+adaptive --batch-size 1 \
          --num-prompts 16 --max-tokens 128 --temperature 0 1 --num-iters 3 --json "$OUT/spec_b1$TAG.json" 2>&1 \
          | grep -v "it/s" | tee "$OUT/spec_b1$TAG.log" | tail -16 ;;
  esac
done
