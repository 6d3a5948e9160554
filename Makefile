# Two commands on a fresh machine with only Python 3.10+:
#   make lab    set everything up (a virtual environment in .venv) and open the course in JupyterLab
#   make test   set everything up and run every test and every notebook
#   make test-lib   the library's tests alone (no notebooks): the fast loop while changing course_lib
#   make lint       ruff on the library, tests, benchmarks and notebooks (configured in pyproject.toml)
# On a Linux machine without an NVIDIA GPU, PyPI's default torch is a multi-GB CUDA build: ask for the
# CPU build instead, e.g.  make lab TORCH_PIP_ARGS="--index-url <PyTorch's CPU wheel index>"  (README).
PYTHON ?= python3
VENV ?= .venv
# torch as course_lib/requirements.txt (the one dependency list) asks for it; CI pins the CPU build.
TORCH ?= $(shell grep -E '^torch\b' course_lib/requirements.txt)
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
BIN := $(VENV)/bin
STAMP := $(VENV)/.course-installed

.PHONY: setup lab test test-lib lint doctor clean

setup: $(STAMP)

$(STAMP): pyproject.toml course_lib/requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	touch $(STAMP)

lab: setup
	$(BIN)/python -m jupyter lab notebooks/00_welcome.ipynb

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
