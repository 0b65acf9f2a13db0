#!/usr/bin/env bash
# On the GPU machine: the forward / paged kernels' GPU tests, then `bench kernels --prefill` for this tree
# and for .carry/base (a `git archive` of the base commit's pageflash/) alternating, ROUNDS times.
#   scripts/gpu_prefill_ab.sh [tests] [ab]
source scripts/gpu_env.sh
ROUNDS=${ROUNDS:-2}
rc=0
[ $# -eq 0 ] && set -- tests ab
for step in "$@"; do
  case $step in
    tests)
      python -m pytest -q -ra tests/gpu/test_kernels_gpu.py -k "fa_ or paged or backend" tests/gpu/test_window_gpu.py \
        2>&1 | tee "$OUT/tests.log" | tail -6 || rc=1 ;;
    ab)
      for r in $(seq "$ROUNDS"); do
        for tree in new base; do
          if [ $tree = base ]; then pp=.carry/base; else pp=.; fi
          PYTHONPATH=$pp python -m pageflash.bench.kernels --prefill --json "$OUT/prefill_${tree}_$r.json" \
            2>&1 | tee "$OUT/prefill_${tree}_$r.log" | grep "^prefill" | sed "s/^/$tree $r: /" || rc=1
        done
      done ;;
  esac
done
exit $rc
