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

.PHONY: setup lab test test-lib lint doctor clean

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
	$(BIN)/python -m course_lib doctor

clean:
	rm -rf $(VENV) *.egg-info
