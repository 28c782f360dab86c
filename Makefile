# The two commands of the README: `make demo` runs the main job, `make test` the suite.
# Each creates .venv when missing. torch is pinned to the CPU build on local disk
# (never a multi-GB CUDA wheel); cupy is not installed for CPU work. The ray extra
# (~80 MB) lets the Ray launcher tests run instead of being skipped.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0

$(VENV)/.installed: pyproject.toml setup.py rlinf/util/_fastcopy.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[test,demo,ray]' '$(TORCH)'
	touch $@

.PHONY: install demo test bench clean
install: $(VENV)/.installed

demo: install
	$(PY) -m rlinf demo

test: install
	$(PY) -m pytest -q -p no:cacheprovider

bench: install
	$(PY) -m rlinf bench

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build rlinf/util/_fastcopy*.so
