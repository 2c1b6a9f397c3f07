"""Mirrors tt-metal models/demos/llama3_70b_galaxy/tt/model_config.py @ c7dc95923b72 (`TtModelArgs`,
`LlamaOptimizations`): what the Galaxy Llama model args read from the environment and refuse
before any weight is loaded, in the real order:
- the submesh's device count is looked up in its device-name table (0, 1, 2, 8, 32 devices), so
  any other count (a 16-device submesh) fails there with a KeyError;
- `assert not (LLAMA_DIR and HF_MODEL)`, then LLAMA_DIR (a Meta-style folder that must exist) or
  HF_MODEL, and an assert when neither is set;
- "Unsupported number of devices: N. Only 32 devices (Galaxy) are supported." for 1, 2 or 8.
Nothing here loads a checkpoint.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GALAXY_DEVICE_NAMES = {0: "CPU", 1: "N150", 2: "N300", 8: "T3K", 32: "TG"}


@dataclass
class LlamaOptimizations:
    bfp4_mlp: bool

    @classmethod
    def accuracy(cls, model_name: str) -> LlamaOptimizations:
        return cls(bfp4_mlp="70B" in model_name)

    @classmethod
    def performance(cls, model_name: str) -> LlamaOptimizations:
        return cls(bfp4_mlp=True)


def _device_count(mesh_device: Any) -> int:
    return mesh_device.get_num_devices() if mesh_device else 0


def _require_galaxy(num_devices: int) -> None:
    if num_devices != 32:
        raise ValueError(f"Unsupported number of devices: {num_devices}. Only 32 devices (Galaxy) are supported.")


class TtModelArgs:
    def __init__(self, mesh_device: Any, instruct: bool = False, dummy_weights: bool = False,
                 max_batch_size: int = 1, max_seq_len: int = 1024 * 128,
                 optimizations: Any = LlamaOptimizations.accuracy) -> None:
        self.num_devices = _device_count(mesh_device)
        self.device_name = GALAXY_DEVICE_NAMES[self.num_devices]
        self.mesh_device, self.max_batch_size, self.max_seq_len = mesh_device, max_batch_size, max_seq_len
        llama_dir, hf_model = os.getenv("LLAMA_DIR"), os.getenv("HF_MODEL")
        assert not (llama_dir and hf_model), "Only one of LLAMA_DIR or HF_MODEL should be set"
        if llama_dir:
            self.CKPT_DIR = self.TOKENIZER_PATH = llama_dir
            self.model_name = os.path.basename(llama_dir)
        elif hf_model:
            self.CKPT_DIR = self.TOKENIZER_PATH = hf_model
            self.model_name = hf_model
        else:
            assert False, ("Please set HF_MODEL to a HuggingFace name e.g. meta-llama/Llama-3.1-8B-Instruct or "
                           "LLAMA_DIR to a Meta-style checkpoint directory")
        if not dummy_weights and not hf_model:
            assert os.path.exists(self.CKPT_DIR), f"Checkpoint directory {self.CKPT_DIR} does not exist"
        self.instruct = instruct or "instruct" in self.CKPT_DIR.lower()
        self.optimizations = optimizations(self.model_name) if callable(optimizations) else optimizations
        _require_galaxy(self.num_devices)
