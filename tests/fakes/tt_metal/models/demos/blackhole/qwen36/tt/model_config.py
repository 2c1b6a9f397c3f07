"""Mirrors tt-metal models/demos/blackhole/qwen36/tt/model_config.py @ 009f48d45918d773b0023cb6b71f91a4c6f35712
(index id 68647328650) `Qwen36ModelArgs`: a tt_transformers ModelArgs (so it reads HF_MODEL and takes
batch sizes 1, 2, 4, 8, 16, 32), whose HF_MODEL defaults to Qwen/Qwen3.6-27B (`os.environ.setdefault`)."""
from __future__ import annotations

import os
from typing import Any

from models.tt_transformers.tt.model_config import ModelArgs


class Qwen36ModelArgs(ModelArgs):
    def __init__(self, mesh_device: Any = None, max_batch_size: int = 1, max_seq_len: int = 2048,
                 **kwargs: Any) -> None:
        os.environ.setdefault("HF_MODEL", "Qwen/Qwen3.6-27B")
        super().__init__(mesh_device, max_batch_size=max_batch_size, max_seq_len=max_seq_len, **kwargs)
        self.num_devices = mesh_device.get_num_devices() if mesh_device is not None else 1
