#!/usr/bin/env bash
# Run 50 (one H100): every decode split-kernel variant's time and registers (scripts/decode_variants_probe.py)
# at W-attn-decode's heads and SmolLM2's, then the speculative-decoding GPU tests (StepGraphs' inputs
# through HostStage since e05f8f4) and the decode kernel tests.
source "$(dirname "$0")/gpu_env.sh"
OUT=$(realpath "$OUT")
for h in ${HEADS:-32,8,128 9,3,64}; do
  timeout 240 python3 scripts/decode_variants_probe.py $h > $OUT/variants_${h//,/_}.log 2>&1; echo "probe $h rc=$?"
done
timeout 250 python3 -m pytest -q -ra tests/gpu/test_spec_gpu.py tests/gpu/test_kernels_gpu.py -k "spec or decode or rope" \
  > $OUT/tests.log 2>&1; echo "tests rc=$?"; tail -3 $OUT/tests.log
for h in ${HEADS:-32,8,128 9,3,64}; do cat $OUT/variants_${h//,/_}.log | grep -v "^ *rope [01] quant" ; grep "regs" $OUT/variants_${h//,/_}.log | sort | uniq -c | head -30; done
