# fractal-edge: every entry point a user or CI needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
CACHE   := .cache
NODES   ?= 3
# Stamps: the workstation install (the node plus the `[compiler]` extra: TVM, onnx, the demo's
# data and broker; enough for `make demo`, which compiles models) and the dev extras (tests,
# torch, browsers). A board's node alone is `pip install fractal-edge` (no compiler).
RUNTIME := $(VENV)/.installed-runtime
DEV     := $(VENV)/.installed-dev

.PHONY: install install-dev test test-fast demo bench soak conformance check docs sysroot sysroot-aarch64 sysroot-riscv64 pycheck clean

install: $(RUNTIME)
install-dev: $(DEV)

# Refuse a Python older than 3.11 before creating anything.
pycheck:
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null || { \
	  echo "error: fractal-edge needs Python >= 3.11; '$(PY)' is $$($(PY) --version 2>/dev/null || echo 'not found') (help: pick another interpreter, e.g. make PY=python3.11 $(MAKECMDGOALS))" >&2; exit 1; }

$(BIN)/python: | pycheck
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(RUNTIME): pyproject.toml setup.py federation/_gmac.c | $(BIN)/python
	$(BIN)/pip install -q -e '.[compiler]'
	touch $@

$(DEV): pyproject.toml $(RUNTIME)
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# aarch64 Python sysroot for qemu-user (Debian arm64 packages + aarch64 wheels), cached in .cache/
# riscv64: Debian trixie python3.13 + numpy (C-backend artifacts need no TVM), private apt config
sysroot: sysroot-aarch64 sysroot-riscv64
sysroot-aarch64: $(CACHE)/sysroot-aarch64/.done
$(CACHE)/sysroot-aarch64/.done: firmware/sysroot.sh
	bash firmware/sysroot.sh aarch64 $(CACHE)/sysroot-aarch64
sysroot-riscv64: $(CACHE)/sysroot-riscv64/.done
$(CACHE)/sysroot-riscv64/.done: firmware/sysroot.sh firmware/sysroot-riscv64.lock firmware/debs.py
	bash firmware/sysroot.sh riscv64 $(CACHE)/sysroot-riscv64

test: install-dev sysroot
	$(BIN)/pytest -q --durations=30 tests

test-fast: install-dev
	$(BIN)/pytest -q -m "not slow" tests

demo: install
	$(BIN)/fractal swarm --nodes $(NODES)

bench: install-dev sysroot
	$(BIN)/pytest -q -p no:cacheprovider --override-ini addopts= -m bench tests/bench

# Not part of `make test`: a 4-node swarm on namespaced hosts doing rounds for SOAK_MINUTES while
# nodes are killed/restarted and junk MQTT messages are injected; prints a JSON report (needs root).
SOAK_MINUTES ?= 5
soak: install-dev
	$(BIN)/python -m harness.soak --minutes $(SOAK_MINUTES) --out $(CACHE)/soak-report.json

# Not part of `make test` in full: every ONNX backend test case, every light model-zoo network and
# every case of ONNX's operator (node) suite through the project, onnxruntime and (not for the node
# suite) plain TVM, cached in .cache/conformance; prints the per-case report and the node suite's
# table by operator (`make test` runs a stable subset of the node suite).
conformance: install-dev
	CONFORMANCE_FULL=1 $(BIN)/pytest -q -s -p no:cacheprovider tests/compiler/test_conformance.py
	PYTHONPATH=$(CURDIR) $(BIN)/python -m tests.compiler.conformance report
	PYTHONPATH=$(CURDIR) $(BIN)/python -m tests.compiler.conformance table node

check: install-dev
	$(BIN)/ruff check fractal compiler federation edgenode api firmware deploy bench harness tests
	$(BIN)/mypy fractal compiler federation edgenode api firmware deploy bench harness tests/edgenode/fakes.py \
		tests/federation/test_transport_types.py tests/fleet/fake_link.py

# The documentation site (docs/ + mkdocs.yml) into build/site; --strict: a broken link or anchor fails.
docs: install-dev
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(CACHE) build *.egg-info
