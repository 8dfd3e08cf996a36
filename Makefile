# One-command set-up: `make demo` runs the main job, `make test` runs the tests.
# Downloads (the llama-cpp-python sdist, models) are cached in $(EAGLE_LLAMACPP_CACHE),
# keyed by sha256, and the C/C++ build uses ccache (installed if missing).

PYTHON     ?= python3
VENV       ?= .venv
BUILD      ?= build
CMAKE_ARGS ?=
JOBS       ?= $(shell nproc)
export EAGLE_LLAMACPP_CACHE ?= $(HOME)/.cache/eagle-llamacpp
# ccache keys on paths relative to the checkout, so a fresh clone elsewhere still hits
export CCACHE_BASEDIR ?= $(CURDIR)

SDIST_SHA := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
SDIST     := $(EAGLE_LLAMACPP_CACHE)/sdist/$(SDIST_SHA)/llama_cpp_python-0.3.36.tar.gz
PY        := $(VENV)/bin/python

.PHONY: all build setup demo test clean

all: setup

# configure fetches + verifies the sdist and applies patches/ (CMakeLists.txt)
build: ccache
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_ARGS)
	cmake --build $(BUILD) -j $(JOBS)

.PHONY: ccache
ccache:
	@command -v ccache >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && \
		(apt-get install -y -qq ccache >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq ccache)) >/dev/null 2>&1) || true

$(VENV)/.installed: pyproject.toml $(BUILD)/bin/libllama.so
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# llama-cpp-python's Python bindings only: its own native build is switched off
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(PY) -m pip install -q $(SDIST)
	$(PY) -m pip install -q $(BUILD)/llama.cpp/gguf-py
	$(PY) -m pip install -q -e '.[train,bench,test]'
	touch $@

$(BUILD)/bin/libllama.so:
	$(MAKE) build

setup: build $(VENV)/.installed

demo: setup
	$(PY) -m eagle_llamacpp.cli demo

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(BUILD) $(VENV)
