# The README's two commands: `make demo` and `make test`. Both set everything up first
# (idempotent: a second run reuses .venv and only rebuilds when sources changed).
# `make gpu-test` (a machine with an NVIDIA GPU) is separate: its own interpreter with a CUDA
# build of torch 2.13.0 (.venv-gpu, or GPU_PYTHON=...) and its own build tree (build/gpu);
# it never touches .venv or the extensions `make test` uses. See scripts/gpu_test.sh, docs/gpu.md.
# The torch releases statestore supports and tests (README "Install"). TORCH: the one `make
# demo`/`make test` install (its CPU wheel) and pyproject.toml's build pin; TORCH_NEWEST: the
# newest the registry gives, which `make test-torch` (CI, after `make test`) installs a clean
# clone against in an environment of its own outside the checkout. A new torch release is
# one line: TORCH_NEWEST (tests/test_build.py checks the other pins follow TORCH).
TORCH        := 2.13.0
TORCH_NEWEST := 2.14.1
export TORCH
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-install
SOURCES := Makefile pyproject.toml setup.py scripts/system_deps.sh scripts/install_tensornvme.sh \
           $(shell find csrc -type f 2>/dev/null)

.PHONY: setup demo test test-simd test-torch cuda-check gpu-test clean

setup: $(STAMP)

$(PY):
	python3 -m venv $(VENV)

# scripts/install_tensornvme.sh: the `tensornvme` engine, built from its source release
# (skipped when installed; a failed build fails the set-up with the reason).
$(STAMP): $(PY) $(SOURCES)
	bash scripts/system_deps.sh
	$(PY) -m pip install -q --disable-pip-version-check torch==$(TORCH) setuptools wheel ninja
	echo torch==$(TORCH) > $(VENV)/torch-constraint.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -c $(VENV)/torch-constraint.txt -e '.[test]'
	bash scripts/install_tensornvme.sh $(PY)
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py

# STATESTORE_REQUIRE_TENSORNVME=1: the TensorNVMe store's tests fail, not skip, without it.
# Two runs: the `serial` tests (peak memory bounds, timing-sensitive under a second busy
# process) alone, collected from the files that hold one (SERIAL_FILES: a whole collection
# imports every test module and costs seconds), then every other test on pytest-xdist (a
# test extra): TEST_JOBS workers (the cores, at most 4) taking tests as they free up
# (--dist worksteal: a worker that runs out takes half of another's queue, so one long file
# no longer ends the run alone; module fixtures, e.g. a zygote process, start once per
# worker), the files holding `slow` tests first (tests/conftest.py). TEST_JOBS=0 runs the
# second in one process. pytest's exit status goes through: a failure, or no test collected
# (5), fails the target. --durations=15 prints the slowest tests, where the suite's time
# budget (6 minutes on 2 cores) goes first.
TEST_JOBS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); [ $$n -gt 4 ] && n=4; echo $$n)
SERIAL_FILES := $(shell grep -rl --include='test_*.py' 'pytest\.mark\.serial' tests)
PYTEST := STATESTORE_REQUIRE_TENSORNVME=1 $(PY) -m pytest -q -p no:cacheprovider
test: setup
	$(if $(SERIAL_FILES),$(PYTEST) -m serial $(SERIAL_FILES))
	$(PYTEST) -m "not serial" -n $(TEST_JOBS) --dist worksteal --durations=15

# The suite as an AVX2 host (SIMD=avx2) or one without vector units (SIMD=scalar) runs it, on
# a host with more: STATESTORE_SIMD caps the CPU paths the process sees (docs/kernels.md).
# TESTS narrows it (CI: TESTS=tests/kernels on AVX-512 hosts).
SIMD  ?= avx2
TESTS ?= tests
test-simd: setup
	STATESTORE_SIMD=$(SIMD) $(PYTEST) -n $(TEST_JOBS) --dist worksteal $(TESTS)

# The README's install of a clean clone into an environment with torch $(TORCH_NEWEST) (outside
# the checkout: $$STATESTORE_CACHE, default ~/.cache/statestore), then the build, kernel,
# store-conformance and checkpoint tests there (scripts/test_torch.sh). TORCH_VERSION=X.Y.Z
# tries another release.
TORCH_VERSION ?= $(TORCH_NEWEST)
test-torch:
	bash scripts/test_torch.sh $(TORCH_VERSION)

cuda-check:
	bash scripts/check_cuda.sh

# every CUDA test (pytest -m cuda) and benchmarks/gpu_step.py --quick, built with CUDA
gpu-test:
	bash scripts/gpu_test.sh

clean:
	rm -rf build *.egg-info statestore/*.so $(VENV) .venv-gpu
