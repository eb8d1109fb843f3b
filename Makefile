# Two commands: `make demo` (set-up + the main job) and `make test` (set-up + the full suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RUN_ID := $(shell date +%Y%m%d-%H%M%S)

.PHONY: setup demo test test-slow lint bench clean

setup: $(STAMP)

# Use an already-importable torch when there is one, else the pinned CPU build.
$(STAMP): pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "using the torch already installed for $(PYTHON)"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/wanka train configs/demo.toml --nproc 2 --set run.dir=runs/demo-$(RUN_ID)

# Two at a time (pytest-xdist), then the timing-sensitive tests alone (tests/conftest.py). The
# slowest tests are listed at the end of each phase: CI has a time budget (~20 min on 2 cores).
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not serial" --durations=15; a=$$?; \
	$(PY) -m pytest -q -m "serial and not slow" --durations=15; b=$$?; exit $$(( a || b ))

# Drills, real benchmark runs and long compiles: not in CI (`make test`), run before a release.
test-slow: setup
	$(PY) -m pytest -q -m slow

lint: setup
	$(VENV)/bin/ruff check src tests && $(VENV)/bin/ruff format --check src tests

bench: setup
	$(VENV)/bin/wanka bench train --out runs/bench/train.json

clean:
	rm -rf runs .cache
