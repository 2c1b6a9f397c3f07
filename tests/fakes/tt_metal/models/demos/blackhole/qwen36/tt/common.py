"""Mirrors tt-metal models/demos/blackhole/qwen36/tt/common.py @ 296021c48c507d9e59754c673ba7732aee6e3549
(index id 58899569590) `create_tt_model`: `hf_model`, when given, is written to HF_MODEL ("the single
source of truth"), then Qwen36ModelArgs is built for the whole mesh with the whole max_batch_size."""
from __future__ import annotations

import os
from typing import Any

from models.demos.blackhole.qwen36.tt.model_config import Qwen36ModelArgs
from models.tt_transformers.tt.generator import TTNN


def create_tt_model(mesh_device: Any, max_batch_size: int = 1, max_seq_len: int = 2048, n_layers: int | None = None,
                    layer_indices: Any = None, hf_model: str | None = None) -> tuple[Any, Any, Any]:
    if hf_model is not None:
        os.environ["HF_MODEL"] = hf_model
    args = Qwen36ModelArgs(mesh_device=mesh_device, max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    TTNN.recorder.add("model.qwen36_create_tt_model", hf_model=os.environ["HF_MODEL"], num_devices=args.num_devices,
                      max_batch_size=max_batch_size, max_seq_len=max_seq_len)
    return args, None, None
