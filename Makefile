# Two entry points for a fresh machine with python3 >= 3.11:
#   make train   set up .venv, train the built-in number-words task, translate a few sentences, print accuracy
#   make test    set up .venv, run the test suite
# and `make bench` (docs/performance.md): the benchmark suite, its absl flags in BENCH_ARGS, e.g.
#   make bench BENCH_ARGS="--quick --sections=machine,decode --noflax --notorch"
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
WORKDIR ?= runs/number_words
PYTEST_ARGS ?=
BENCH_ARGS ?=
# Transparent huge pages for XLA's large host buffers (glibc >= 2.35; ignored elsewhere): ~1.4x faster CPU
# training steps. `python -m experiments.*` programs add it themselves; this covers pytest too.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: setup train test test-all bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "python3 >= 3.11 is required, found " + sys.version'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,interop,wandb,gcs,serve,tpu]'
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m experiments.train --workdir=$(WORKDIR)
	printf 'twenty-one\nthree hundred forty-five thousand six hundred seventy-eight\none hundred one thousand one\n' \
	  | $(BIN)/python -m experiments.translate --workdir=$(WORKDIR)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadscope -m 'not slow' $(PYTEST_ARGS)

test-all: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadscope $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python -m benchmarks.flax_peer   # the Flax example's models.py from the flax sdist (PyPI)
	$(BIN)/python -m benchmarks.run $(BENCH_ARGS)

clean:
	rm -rf $(VENV) runs
