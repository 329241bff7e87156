# Quick start: `make demo`, `make test`. Both set up .venv first (Python 3.11).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: install demo test test-gpu bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# both frameworks, the server and the test tools, at the pinned versions of constraints.txt
	# (torch 2.13.0 resolves to the CPU wheel shipped on these machines)
	$(PY) -m pip install -q -c constraints.txt -e ".[all,test]"
	touch $@

demo: install
	$(PY) demo.py

# two pytest-xdist workers: CI's two cores (the interpreted kernels are single-threaded Python)
test: install
	$(PY) -m pytest -q -m "not long" -n 2 --dist loadgroup

# On a GPU machine (see benchmarks/README.md for the device-tool command).
test-gpu:
	python3 -m pytest -q -m gpu

bench:
	python3 -m benchmarks.run

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
