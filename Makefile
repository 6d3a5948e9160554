# Two commands on a fresh machine with only Python 3.10+:
#   make lab    set everything up (a virtual environment in .venv) and open the course in JupyterLab
#   make test   set everything up and run every test and every notebook
#   make test-lib   the library's tests alone (no notebooks): the fast loop while changing course_lib
#   make lint       ruff on the library, tests, benchmarks and notebooks (configured in pyproject.toml)
# On a Linux machine without an NVIDIA GPU, PyPI's default torch is a multi-GB CUDA build: ask for the
# CPU build instead, e.g.  make lab TORCH_PIP_ARGS="--index-url <PyTorch's CPU wheel index>"  (README).
# JupyterLab's own options go in LAB_ARGS, e.g. on a remote VM:  make lab LAB_ARGS="--no-browser --port 8888"
# The browser test (tests/browser) needs the `browser` extra and Chromium:  make test EXTRAS=test,browser
PYTHON ?= python3
VENV ?= .venv
# torch as course_lib/requirements.txt (the one dependency list) asks for it; CI pins the CPU build.
TORCH ?= $(shell grep -E '^torch\b' course_lib/requirements.txt)
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
LAB_ARGS ?=
EXTRAS ?= test
BIN := $(VENV)/bin
comma := ,
STAMP := $(VENV)/.course-installed-$(subst $(comma),-,$(EXTRAS))
# JupyterLab refuses to start as root (Docker containers, cloud GPU VMs) unless told it may.
ROOT_ARGS := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)

.PHONY: setup lab test test-lib lint doctor clean hub hub-env hub-stop hub-status hub-roster

setup: $(STAMP)

$(STAMP): pyproject.toml course_lib/requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

lab: setup
	$(BIN)/python -m jupyter lab $(ROOT_ARGS) $(LAB_ARGS) notebooks/00_welcome.ipynb

test: setup
	$(BIN)/python -m pytest --nbval-lax --nbval-current-env --nbval-cell-timeout=600 -q $(PYTEST_ARGS)

test-lib: setup
	$(BIN)/python -m pytest -q tests/ $(PYTEST_ARGS)

lint: setup
	$(BIN)/python -m ruff check .

doctor: setup
	HUB_PREFIX=$(HUB_PREFIX) $(BIN)/python -m course_lib doctor

clean:
	rm -rf $(VENV) *.egg-info

# One VM for a class (README, "For instructors"): JupyterHub with a seat (GPUs, a port block, a home with the
# notebooks) per learner, bound to 127.0.0.1. As root:
#   export COURSE_HUB_PASSWORD=... COURSE_HUB_ADMIN_PASSWORD=...   (never in a file)
#   make hub LEARNERS=4 GPUS_PER_LEARNER=2      make hub-stop      make hub-roster LEARNERS=4 (a dry run)
# GPUS_PER_LEARNER empty: the GPUs shared out evenly; 0: a CPU class. The environment is a venv under HUB_PREFIX
# (the learners run it: not under /root, course_lib installed non-editable).
HUB_PREFIX ?= /opt/course-hub
# The learners run the hub's Python: a system one (a pyenv or conda Python under /root is closed to them).
HUB_PYTHON ?= $(firstword $(wildcard /usr/bin/python3) $(PYTHON))
LEARNERS ?= 2
GPUS_PER_LEARNER ?=
LEARNER_NAMES ?=
HUB_PORT ?= 8000
HUB_PORT_BASE ?= 20000
HUB_PORT_BLOCK ?= 100
HUB_PROXY_VERSION ?= 5
# HUB_SPAWNER=slurm: each learner's JupyterLab a SLURM job (batchspawner) in SLURM_PARTITION, GPUs by --gres
HUB_SPAWNER ?= local
SLURM_PARTITION ?=
HUB_BIN := $(HUB_PREFIX)/venv/bin
HUB_STAMP := $(HUB_PREFIX)/venv/.course-installed
HUB_ARGS = --prefix $(HUB_PREFIX) --learners $(LEARNERS) --gpus-per-learner "$(GPUS_PER_LEARNER)" \
	--names "$(LEARNER_NAMES)" --port $(HUB_PORT) --port-base $(HUB_PORT_BASE) --port-block $(HUB_PORT_BLOCK) \
	--spawner $(HUB_SPAWNER) --partition "$(SLURM_PARTITION)"

hub-env: $(HUB_STAMP)

$(HUB_STAMP): pyproject.toml course_lib/requirements.txt $(shell find course_lib -name '*.py') $(wildcard notebooks/*.ipynb)
	mkdir -p $(HUB_PREFIX) && chmod 755 $(HUB_PREFIX)
	test -x $(HUB_BIN)/python || $(HUB_PYTHON) -m venv $(HUB_PREFIX)/venv
	$(HUB_BIN)/python -m pip install --quiet --upgrade pip
	$(HUB_BIN)/python -m pip install --quiet "$(TORCH)" $(TORCH_PIP_ARGS)
	$(HUB_BIN)/python -m pip install --quiet --force-reinstall --no-deps .
	$(HUB_BIN)/python -m pip install --quiet ".[hub]"
	cd / && $(HUB_BIN)/python -m course_lib.hub prepare --prefix $(HUB_PREFIX) --notebooks $(CURDIR)/notebooks \
		--proxy-version $(HUB_PROXY_VERSION)
	touch $(HUB_STAMP)

hub: hub-env
	cd / && $(HUB_BIN)/python -m course_lib.hub up $(HUB_ARGS)

hub-roster: hub-env
	cd / && $(HUB_BIN)/python -m course_lib.hub roster $(HUB_ARGS)

hub-stop:
	@test -x $(HUB_BIN)/python || { echo "hub: no hub environment in $(HUB_PREFIX)"; exit 1; }
	cd / && $(HUB_BIN)/python -m course_lib.hub stop --prefix $(HUB_PREFIX)

hub-status:
	cd / && $(HUB_BIN)/python -m course_lib.hub status --prefix $(HUB_PREFIX)
