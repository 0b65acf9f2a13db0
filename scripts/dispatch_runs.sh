#!/usr/bin/env bash
# On the GPU machine: W-decode1 in ROUNDS fresh processes per tree (working tree, then BASE),
# alternating, each printing the skinny dispatch's choice per shape (INFO log) and its decode tok/s:
# shows whether a per-process choice flips and what a flip costs.  scripts/dispatch_runs.sh .carry/base
BASE=${1:-.carry/base}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
run() { (cd "$1" && $PY -c "import logging, sys; logging.basicConfig(level=logging.INFO, format='%(message)s')
from pageflash.cli import main
sys.argv = ['pageflash', 'bench', 'latency', '--model', 'llama-3-8b', '--input-len', '128', '--output-len', '256',
            '--disable-tqdm', '--json', '$OUT/$2.json']
main()" 2>&1 | grep -E "^linear .* at M=1( with [a-z_]+)?:|^llama-3-8b" | sed "s/^/$2 /"); }
for i in $(seq 1 ${ROUNDS:-3}); do run . "new$i"; run "$BASE" "base$i"; done
