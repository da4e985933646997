# The README's two commands: `make demo` and `make test`. Both set everything up first
# (idempotent: a second run reuses .venv and only rebuilds when sources changed).
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-install
SOURCES := pyproject.toml setup.py $(shell find csrc -type f 2>/dev/null)

.PHONY: setup demo test cuda-check clean

setup: $(STAMP)

$(PY):
	python3 -m venv $(VENV)

$(STAMP): $(PY) $(SOURCES)
	bash scripts/system_deps.sh
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 setuptools wheel ninja
	$(PY) -m pip install -q --disable-pip-version-check --no-build-isolation -e '.[test]'
	touch $(STAMP)

demo: setup
	$(PY) examples/demo.py

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

cuda-check:
	bash scripts/check_cuda.sh

clean:
	rm -rf build *.egg-info statestore/*.so $(VENV)
