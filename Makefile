# Two commands set everything up on a fresh machine:
#   make demo   -> create .venv, install relign, run the demo job
#   make test   -> create .venv, install relign + test deps, run the whole test suite
#
# torch is installed first with an exact pin: on a CPU-only machine `pip install torch==2.13.0`
# takes the CPU wheel, while a looser requirement would pull gigabytes of CUDA wheels.
# Override with `make TORCH_SPEC=torch==X.Y.Z` (or pre-install torch in VENV) on GPU machines.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.relign-installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/relign demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --durations=15

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python bench/sft_throughput.py
	$(BIN)/python bench/grpo_step.py
	$(BIN)/python bench/rl_packing.py
	$(BIN)/python bench/dpo_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
