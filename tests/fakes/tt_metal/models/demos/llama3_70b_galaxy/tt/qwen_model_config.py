"""Mirrors tt-metal models/demos/llama3_70b_galaxy/tt/qwen_model_config.py @ b5e7e747cbaf
(`TtQwenModelArgs`, the Galaxy Qwen3-32B model args): a subclass of the Galaxy TtModelArgs with
its own __init__, which
- looks the submesh's device count up in the same device-name table (KeyError for 16);
- reads HF_MODEL only: without it, `assert False, "Please set HF_MODEL to a HuggingFace name e.g.
  Qwen/Qwen3-32B"` (LLAMA_DIR is never read, so it neither helps nor conflicts);
- raises "Unsupported number of devices: N. Only 32 devices (Galaxy) are supported." for 1, 2, 8.
"""
from __future__ import annotations

import os
from typing import Any

from models.demos.llama3_70b_galaxy.tt.model_config import (GALAXY_DEVICE_NAMES, LlamaOptimizations, TtModelArgs,
                                                            _device_count, _require_galaxy)


class TtQwenModelArgs(TtModelArgs):
    def __init__(self, mesh_device: Any, instruct: bool = False, dummy_weights: bool = False,
                 max_batch_size: int = 1, max_seq_len: int = 40960,
                 optimizations: Any = LlamaOptimizations.accuracy) -> None:
        self.num_devices = _device_count(mesh_device)
        self.device_name = GALAXY_DEVICE_NAMES[self.num_devices]
        self.mesh_device, self.max_batch_size, self.max_seq_len = mesh_device, max_batch_size, max_seq_len
        hf_model = os.getenv("HF_MODEL")
        if hf_model:
            self.CKPT_DIR = self.TOKENIZER_PATH = self.model_name = hf_model
        else:
            assert False, "Please set HF_MODEL to a HuggingFace name e.g. Qwen/Qwen3-32B"
        self.instruct = instruct or "instruct" in self.CKPT_DIR.lower()
        self.optimizations = optimizations(self.model_name) if callable(optimizations) else optimizations
        _require_galaxy(self.num_devices)
