#!/usr/bin/env bash
# Run 49 (one H100): the fused rope decode kernel with the new key first (kn / vn dead before the key
# loop), against the tree in .carry/base. Kernel probe (registers, timing), GPU decode tests, then
# llama-3-8b dummy latency new / base alternating, and a long-context step profile (32 x 6000 keys).
source "$(dirname "$0")/gpu_env.sh"
OUT=$(realpath "$OUT")
timeout 200 python3 scripts/engine_decode_attn_probe.py 32 6000 > $OUT/eprobe.log 2>&1; echo "probe rc=$?"
grep -E "engine\+rope sp|engine sp|cudnn  |ROPE True n64 w4 s1" $OUT/eprobe.log | sort -u
timeout 200 python3 -m pytest -q tests/gpu/test_kernels_gpu.py -k "decode or rope" 2>&1 | tail -2
lat() {  # dir label
  (cd $1 && timeout 150 python3 -m pageflash.cli bench latency --model llama-3-8b --load-format dummy \
    --input-len 128 --output-len 128 --batch-size 1 64 --num-iters 2 --disable-tqdm --json $OUT/$2.json \
    2>&1 | grep "^llama-3-8b" | sed "s/^/$2 /")
}
for i in 1 2; do lat . new$i; lat .carry/base base$i; done
for d in . .carry/base; do
  (cd $d && timeout 150 python3 $OLDPWD/scripts/tp_step_profile.py $OUT/long 1 32 6000 12 2>&1 | grep "step ms" | sed "s|^|$d |")
  rm -f $OUT/long.json
done
