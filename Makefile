# Two entry points from a fresh clone: `make demo` and `make test`. Both create the virtual environment,
# install torch==2.13.0 first (the CPU wheel; an unpinned torch would pull several GB of CUDA wheels),
# then this package with its test extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.aot2onnx-installed

.PHONY: demo test test-slow lint bench clean

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

# The training-step benchmark (eager vs inductor vs aot2onnx): writes BENCHMARKS.md and docs/benchmarks.png.
# matplotlib draws the chart; it is only needed here. Pass options with BENCH_ARGS="--models mlp --rounds 3".
BENCH_STAMP := $(VENV)/.aot2onnx-bench-installed

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q matplotlib
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m aot2onnx bench --out BENCHMARKS.md --chart docs/benchmarks.png $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
