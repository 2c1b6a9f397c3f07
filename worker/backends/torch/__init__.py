"""The torch backend (backend.py: TorchBackend), ttserve's reference models (models/), the `--dtype`
rule (dtype.py) and heap trimming after a load (host_heap.py)."""
