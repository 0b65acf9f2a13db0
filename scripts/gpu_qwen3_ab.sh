export OUT PYTHONUNBUFFERED=1
python3 -m pytest -q -x tests/gpu/test_engine_gpu.py tests/gpu/test_spec_gpu.py 2>&1 | tail -4
python3 -m pytest -q -x tests/gpu/test_fused_gpu.py -k "qk_rms" 2>&1 | tail -2
lat() { (cd "$1" && python3 -m pageflash.cli bench latency --model qwen3-8b --input-len 128 --output-len 256 --disable-tqdm --json "$OUT/$2.json" 2>&1 | grep "^qwen3-8b" | sed "s/^/$2 /"); }
for i in 1 2 3; do lat . new$i; lat .carry/base base$i; done
