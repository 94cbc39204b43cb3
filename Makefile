# Two entry points from a fresh clone: `make demo` and `make test`. Both create the virtual environment,
# install requirements.lock's torch first (the CPU wheel where the index has one; an unpinned torch would
# pull several GB of CUDA wheels), then exactly the versions in requirements.lock, then this package without
# resolving anything more.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.aot2onnx-installed
PIP_VERSION := 26.3
# requirements.lock owns the torch the suite runs on (`make lock` moves it); `make check-torch TORCH=2.11.0`
# tries another.
TORCH_PIN := $(shell grep -i '^torch==' requirements.lock)
LATEST := .venv-latest
# The suite runs in pytest-xdist workers, one test file per worker at a time (`--dist loadfile`: the OpInfo
# sweep's last test regenerates opset_tables/ from the records of that file's other tests). Most of a test
# is single-threaded Python (tracing, lowering, session creation), so 2 workers on 2 cores take about half
# the time of one. TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= 2
PYTEST := -m pytest -q -n $(TEST_WORKERS) --dist loadfile

.PHONY: demo demo-web test test-slow test-browser lint bench clean check-latest check-torch lock

$(STAMP): pyproject.toml Makefile requirements.lock aot2onnx/runtime/fused_ops.cc aot2onnx/runtime/native_run.cc
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q pip==$(PIP_VERSION)
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m pip check
	$(PY) -m aot2onnx kernels build
	touch $(STAMP)

# The JavaScript trainer (js/): its npm packages, exactly as js/package-lock.json pins them. Without npm the
# rest installs and tests/test_js_trainer.py skips, saying why. js/.npmrc keeps onnxruntime-node's install
# script from fetching CUDA binaries from outside the npm registry.
JS_STAMP := js/node_modules/.aot2onnx-installed

$(JS_STAMP): js/package.json js/package-lock.json js/.npmrc
	@if command -v npm >/dev/null 2>&1; then \
		npm ci --prefix js --no-audit --no-fund --loglevel=error && touch $(JS_STAMP); \
	else \
		echo "npm is not installed: js/node_modules skipped, the JavaScript trainer's tests will skip"; \
	fi

demo: $(STAMP)
	$(PY) examples/train_transformer_lm.py

# The browser demo: exports a classifier into js/demo/artifact/, then serves js/ on this machine only
# (127.0.0.1) and prints the page's address; the page trains the model with onnxruntime-web and plots the loss.
DEMO_PORT ?= 8000

demo-web: $(STAMP) $(JS_STAMP)
	@test -d js/node_modules/onnxruntime-web || { echo "demo-web needs npm: the page loads onnxruntime-web from js/node_modules"; exit 1; }
	$(PY) examples/export_for_web.py --out js/demo/artifact
	@echo "open http://127.0.0.1:$(DEMO_PORT)/demo/ in a browser (Ctrl-C stops the server)"
	$(PY) -m http.server $(DEMO_PORT) --bind 127.0.0.1 --directory js

lint: $(STAMP)
	$(PY) -m ruff check aot2onnx tests examples scripts

test: $(STAMP) $(JS_STAMP) lint
	$(PY) $(PYTEST)

test-slow: $(STAMP) $(JS_STAMP)
	$(PY) $(PYTEST) -m slow

# The JavaScript trainer in headless Chromium (onnxruntime-web, WebAssembly), also part of test-slow: parity
# with eager and the refusals, and the demo page's screenshot. Needs Debian's chromium (or $$CHROMIUM).
test-browser: $(STAMP) $(JS_STAMP)
	$(PY) -m pytest -q -n 0 -m slow tests/test_js_trainer.py tests/test_js_demo.py

# The training-step benchmark (eager vs inductor vs aot2onnx): writes BENCHMARKS.md and docs/benchmarks.png.
# matplotlib draws the chart; it is only needed here. Pass options with BENCH_ARGS="--models mlp --rounds 3".
BENCH_STAMP := $(VENV)/.aot2onnx-bench-installed

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q matplotlib
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) -m aot2onnx bench --out BENCHMARKS.md --chart docs/benchmarks.png $(BENCH_ARGS)

# The newest releases of every dependency, torch too, in a throwaway environment, and the default suite
# there: finds the next breaking release before users do. `make lock` then moves the lock. The newest torch
# comes from PyPI, whose Linux wheel brings CUDA libraries (about 3 GB; the suite runs on the CPU).
check-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	$(LATEST)/bin/python -m pip install -q --upgrade torch
	$(LATEST)/bin/python -m pip install -q --upgrade $$($(PYTHON) scripts/lock.py names) \
		torch==$$($(LATEST)/bin/python scripts/lock.py torch-version)
	$(LATEST)/bin/python -m pip install -q --no-deps -e .
	$(LATEST)/bin/python -m pip check
	@$(LATEST)/bin/python scripts/lock.py freeze $(LATEST)/bin/python > $(LATEST)/requirements.lock
	@echo "newest releases against requirements.lock:"; diff requirements.lock $(LATEST)/requirements.lock || true
	$(LATEST)/bin/python -m ruff check aot2onnx tests examples scripts
	$(LATEST)/bin/python $(PYTEST) -p no:cacheprovider
	touch $(LATEST)/.passed

# The default suite against another torch from PyPI in a throwaway environment: `make check-torch
# TORCH=2.11.0` (aot2onnx supports 2.11 to 2.14). That torch first (its Linux wheel brings CUDA libraries,
# about 3 GB; the suite runs on the CPU), then requirements.lock's other packages at their pins, with torch
# held where it is, then this package.
CHECK_TORCH := .venv-torch-$(TORCH)

check-torch:
	@case "$(TORCH)" in [0-9]*) ;; *) echo "usage: make check-torch TORCH=2.11.0"; exit 1;; esac
	rm -rf $(CHECK_TORCH)
	$(PYTHON) -m venv $(CHECK_TORCH)
	$(CHECK_TORCH)/bin/python -m pip install -q pip==$(PIP_VERSION)
	$(CHECK_TORCH)/bin/python -m pip install -q torch==$(TORCH)
	grep -iv '^torch==' requirements.lock > $(CHECK_TORCH)/requirements.lock
	$(CHECK_TORCH)/bin/python -m pip install -q -r $(CHECK_TORCH)/requirements.lock torch==$(TORCH)
	$(CHECK_TORCH)/bin/python -m pip install -q --no-deps -e .
	$(CHECK_TORCH)/bin/python -m pip check
	$(CHECK_TORCH)/bin/python $(PYTEST) -p no:cacheprovider

lock:
	@test -f $(LATEST)/.passed || { echo "run 'make check-latest' first: the lock moves only to releases the suite passed on"; exit 1; }
	cp $(LATEST)/requirements.lock requirements.lock
	@echo "requirements.lock moved; raise the upper bounds in pyproject.toml to these versions:"; cat requirements.lock

clean:
	rm -rf $(VENV) $(LATEST) .venv-torch-* build *.egg-info js/node_modules js/demo/artifact aot2onnx/runtime/_fused
