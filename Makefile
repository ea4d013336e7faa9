# Two commands on a fresh machine with only Python and pip:
#   make demo   - a tuning run on the embedded default backend (ONNX Runtime CPU) and the shipped CNN
#   make test   - the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The versions the tests run with: constraints.txt pins torch==2.13.0, the CPU build, not a multi-GB CUDA one.
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,minilm,optuna,efficientnet,ray,torchao]"
	# TensorRT 11.4's Python bindings alone (no libraries): the API-conformance test imports them against stubs.
	$(BIN)/python -m pip install --quiet --no-deps tensorrt-cu13-bindings==11.4.0.106
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/autotune tune configs/cnn-cpu.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check autotune envs tests

clean:
	rm -rf $(VENV) .cache runs/*/
