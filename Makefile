# Two commands on a fresh machine with only Python and pip:
#   make demo   - a tuning run on the embedded default backend (ONNX Runtime CPU) and the shipped CNN
#   make test   - the test suite
#   make test-haswell - the INT8 numeric tests on an emulated AVX2 CPU without AVX-512/VNNI (needs qemu-user)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-haswell lint docs install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The versions the tests run with: constraints.txt pins torch==2.13.0, the CPU build, not a multi-GB CUDA one.
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev,minilm,optuna,efficientnet,ray,torchao,openvino,nncf]"
	# TensorRT 11.4's Python bindings alone (no libraries): the API-conformance test imports them against stubs.
	$(BIN)/python -m pip install --quiet --no-deps tensorrt-cu13-bindings==11.4.0.106
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/autotune tune configs/cnn-cpu.yaml

test: $(STAMP)
	$(BIN)/python -m pytest -q

# ONNX Runtime's U8S8 kernels saturate on x86 without VNNI; qemu's Haswell CPU makes it pick them on any x86 host,
# so the INT8 numeric tests cannot pass on VNNI alone (apt-get install qemu-user). Haswell-noTSX without the system
# features user-mode emulation lacks is Haswell's user ISA (AVX2, FMA, no AVX-512), minus a warning per feature.
QEMU_HASWELL ?= qemu-x86_64 -cpu Haswell-noTSX,-pcid,-x2apic,-tsc-deadline,-invpcid

test-haswell: $(STAMP)
	$(QEMU_HASWELL) $(BIN)/python -m pytest -q -m int8_numeric -p no:cacheprovider

# docs/reference/config.md and cli.md, written from the pydantic models and the argparse parser (tests/test_docgen.py
# fails when they are stale)
docs: $(STAMP)
	$(BIN)/python -m autotune.docgen

lint: $(STAMP)
	$(BIN)/ruff check autotune envs tests
	$(BIN)/ruff format --check autotune envs tests

clean:
	rm -rf $(VENV) .cache runs/*/
