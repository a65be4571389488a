# Entry points a fresh clone needs: each target installs what it uses into .venv first (idempotent:
# the venv is rebuilt only when setup.py or constraints.txt change).
PYTHON ?= PYENV_VERSION=3.12.1 python3.12
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast demo lint bench

$(STAMP): setup.py constraints.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,envs]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

demo: $(STAMP)
	bash launch/midtrain.sh

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m megatron_mimesis.kernels.bench
