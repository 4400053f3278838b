# The two commands of the README: `make demo` (the main job) and `make test` (the test suite).
# Both create .venv and install what they need on first use; later runs skip what is done.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
RANKS ?= 2
# pytest-xdist workers for `make test`: the SLURM/cluster tests (mostly waiting) on one, the rest
# spread over both. More than 2 only oversubscribes a 2-core machine: each MPI test runs 2-4 ranks.
TEST_WORKERS ?= 2
STAMP := $(VENV)/.hpctrain-installed

# Open MPI refuses to run as root unless told; harmless elsewhere.
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
endif
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: setup demo test test-unit test-mpi bench clean help

help:
	@echo "make demo   - set up .venv and run the main job (multi-rank training on shipped data)"
	@echo "make test   - set up .venv and run the whole test suite"
	@echo "make test-unit, make test-mpi - only the pure tests / only those under mpiexec (no SLURM)"
	@echo "make bench  - all-reduce benchmark at $(RANKS) ranks"

setup: $(STAMP)

# Reinstalled when the build inputs change: the metadata, the layout, the C sources.
$(STAMP): pyproject.toml setup.py requirements-dev.txt \
          hpctrain/comm/_shmsync.c hpctrain/comm/_mpiring.c hpctrain/comm/_kernels.h hpctrain/data/_codecs.c
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	@$(PY) -c 'import os, shutil, sys, sysconfig; sys.exit(not (shutil.which("cc") or shutil.which("gcc")) or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
	  || echo "NOTE: no C compiler or Python headers (apt install gcc python3-dev): hpctrain's C extensions (shared-memory sync, HDF5 chunk decoders) will not be built; hpctrain falls back to MPI and to h5py's serial decompression there"
	$(PY) -m pip install -q -e '.[dev,mpi]'
	@touch $@

demo: setup
	$(PY) examples/demo.py --ranks $(RANKS)

test: setup
	bash .ci/services.sh start
	bash tests/mpio/setup-env.sh || echo "NOTE: no parallel-HDF5 test environment (Debian 12 only): the mpio loader test will skip"
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=15 tests

# By kind (the markers in pytest.ini): pure tests only, or the ones under mpiexec without a scheduler.
test-unit: setup
	$(PY) -m pytest -q -m "not (mpi or slurm or cluster or gpu)" tests

test-mpi: setup
	$(PY) -m pytest -q -m "mpi and not (slurm or cluster)" tests

bench: setup
	$(VENV)/bin/hpctrain launch -n $(RANKS) -- hpctrain bench allreduce

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
