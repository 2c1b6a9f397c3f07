"""The simulated mesh (model.py): a model class of tt-metal's generator contract that does no
arithmetic but takes a Tenstorrent system's time, served by the torch backend (TorchBackend)."""
