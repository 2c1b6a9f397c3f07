"""Mirrors tt-metal models/tt_transformers/tt/model_config.py `ModelArgs`: what it reads from the
environment and refuses before any weight is loaded."""
from __future__ import annotations

import os
from typing import Any


class ModelArgs:
    supported_batches = {1, 2, 4, 8, 16, 32}

    def __init__(self, mesh_device: Any, instruct: bool = False, dummy_weights: bool = False,
                 max_batch_size: int = 1, max_seq_len: int = 1024 * 128, optimizations: Any = None) -> None:
        assert not os.getenv("FAKE_DEVICE"), ("FAKE_DEVICE has been renamed to MESH_DEVICE for consistency with "
                                              "vLLM, please update your environment variables and run again.")
        hf_model = os.getenv("HF_MODEL")
        if hf_model:
            self.CKPT_DIR = self.TOKENIZER_PATH = hf_model
            self.model_name = hf_model.strip("/").split("/")[-1]
        else:
            assert False, "Please set HF_MODEL to a HuggingFace name e.g. meta-llama/Llama-3.1-8B-Instruct"
        self.max_batch_size = max_batch_size
        if max_batch_size not in self.supported_batches:
            raise ValueError(f"Batch size {max_batch_size} not supported")
        self.max_seq_len = max_seq_len
