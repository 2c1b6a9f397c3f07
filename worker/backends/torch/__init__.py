"""The torch backend (backend.py: TorchBackend), ttserve's reference models (models/), the `--dtype`
rule (dtype.py) and the host heap: trimmed after a load, then kept between steps (host_heap.py)."""
