#!/usr/bin/env bash
# Run 49 (nvidia-h100-x2): the two-GPU bucket-64 cliff against the block-table copy's width.
#   STEPS='tp2 tp1base ...' scripts/gpu_tp_bt.sh # llama-3-8b dummy: TP=2 / TP=1 with the copy narrowed (default),
#                                   # full (PAGEFLASH_DECODE_BT_COPY=full), TP=2 / TP=1 at a long
#                                   # context, and the same against the tree in .carry/base
# Prints one line per process (label, batch, decode tok/s, step ms); logs under $OUT.
source "$(dirname "$0")/gpu_env.sh"
OUT=$(realpath "$OUT")
lat() {  # label tp in out batches...
  local label=$1 tp=$2 in=$3 out=$4; shift 4
  (cd ${DIR:-.} && timeout ${LIMIT:-150} python3 -m pageflash.cli bench latency --model llama-3-8b --load-format dummy -tp $tp \
    --input-len $in --output-len $out --batch-size "$@" --num-iters 2 --disable-tqdm \
    --json "$OUT/$label.json" > "$OUT/$label.log" 2>&1)
  echo "$label rc=$?" >> "$OUT/rc.txt"
  python3 - "$OUT/$label.json" "$label" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print(sys.argv[2], "no json", e); sys.exit()
for row in r.get("results", r.get("batches", [])):
    print(sys.argv[2], "batch", row["batch_size"], "tok/s %.1f" % row["decode_tok_s_total"],
          "step ms median %.2f p90 %.2f" % (row["step_ms_median"], row["step_ms_p90"]))
PY
}
for step in ${STEPS:-tp2 tp2full tp1 tp1full tp2long}; do
  case $step in
    tp2) lat tp2 2 128 128 1 48 64 ;;
    tp2full) PAGEFLASH_DECODE_BT_COPY=full lat tp2full 2 128 128 64 ;;
    tp1) lat tp1 1 128 128 1 64 ;;
    tp1full) PAGEFLASH_DECODE_BT_COPY=full lat tp1full 1 128 128 1 64 ;;
    tp2long) lat tp2long 2 6000 64 64 ;;
    tp1long) lat tp1long 1 6000 64 64 ;;
    # the same against the tree in .carry/base (a copy of the package before a change)
    tp2fullbase) DIR=.carry/base PAGEFLASH_DECODE_BT_COPY=full lat tp2fullbase 2 128 128 64 ;;
    tp1base) DIR=.carry/base lat tp1base 1 128 128 1 64 ;;
    tp2base) DIR=.carry/base lat tp2base 2 128 128 1 64 ;;
  esac
done 2>&1 | tee "$OUT/table.txt"
tar czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
