# Two set-up-to-result targets: `make demo` (CPU smoke suite + its report) and `make test`.
# Both build a local venv. torch is installed (the CPU wheel, 2.13.0) only where it is missing;
# an interpreter that already has torch/triton (a GPU machine) keeps them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.forge-installed
OUT    ?= results/smoke
REPORT ?= reports/smoke

.PHONY: install demo test test-slow wheels offline-triton clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[dev,peers-cpu]"
	$(BIN)/python -c "import forge_core.native_hooks as n; n.load() or print('make: the C++ update hook was not built:', n.problem())"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/forge-bench sweep --out $(OUT) --resume
	$(BIN)/forge-bench report $(OUT) -o $(REPORT)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

# The slow end-to-end tests (marker `slow`: torchrun cell trees, killed sweeps, family grids through the gate)
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m slow

# Wheels for the GPU machine's Python (3.12, no internet there): see scripts/fetch_wheels.sh
wheels:
	bash scripts/fetch_wheels.sh

# The GPU machine's Triton, beside (not in) the venv, for scripts/offline_sass.py:
#   PYTHONPATH=$(OFFLINE_TRITON) $(BIN)/python scripts/offline_sass.py ...
DEVICE_TRITON  ?= 3.6.0
OFFLINE_TRITON ?= .offline-triton
offline-triton: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps --target $(OFFLINE_TRITON) "triton==$(DEVICE_TRITON)"

clean-venv:
	rm -rf $(VENV)
