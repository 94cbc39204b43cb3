# Two entry points from a fresh clone: `make demo` and `make test`. Both create the virtual environment,
# install torch==2.13.0 first (the CPU wheel; an unpinned torch would pull several GB of CUDA wheels),
# then this package with its test extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.aot2onnx-installed

.PHONY: demo test test-slow lint clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_transformer_lm.py

lint: $(STAMP)
	$(PY) -m ruff check aot2onnx tests examples

test: $(STAMP) lint
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

clean:
	rm -rf $(VENV) build *.egg-info
