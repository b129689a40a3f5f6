# fractal-edge: every entry point a user or CI needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
CACHE   := .cache
NODES   ?= 3

.PHONY: install test test-fast demo bench check sysroot sysroot-aarch64 sysroot-riscv64 riscv-runtime clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# aarch64 Python sysroot for qemu-user (Debian arm64 packages + aarch64 wheels), cached in .cache/
# riscv64: Debian trixie python3.13 + numpy (C-backend artifacts need no TVM), private apt config
sysroot: sysroot-aarch64 sysroot-riscv64
sysroot-aarch64: $(CACHE)/sysroot-aarch64/.done
$(CACHE)/sysroot-aarch64/.done: firmware/sysroot.sh
	bash firmware/sysroot.sh aarch64 $(CACHE)/sysroot-aarch64
sysroot-riscv64: $(CACHE)/sysroot-riscv64/.done
$(CACHE)/sysroot-riscv64/.done: firmware/sysroot.sh
	bash firmware/sysroot.sh riscv64 $(CACHE)/sysroot-riscv64

test: install sysroot
	$(BIN)/pytest -q tests

test-fast: install
	$(BIN)/pytest -q -m "not slow" tests

demo: install
	$(BIN)/fractal swarm --nodes $(NODES)

bench: install sysroot
	$(BIN)/pytest -q -p no:cacheprovider --override-ini addopts= -m bench tests/bench

check: install
	$(BIN)/ruff check compiler federation edgenode api firmware deploy tests
	$(BIN)/mypy compiler federation edgenode api firmware

clean:
	rm -rf $(VENV) $(CACHE) build *.egg-info
