"""A tt-metal-style model that records how it is driven.

Signatures follow tt-metal's Generator as the vLLM plugin calls it: warmup_model_prefill(kv_cache,
enable_trace, can_sample_on_device), guarded by `already_warmed_up_prefill`; warmup_model_decode(
kv_cache, enable_trace, max_batch_size, num_blocks, can_sample_on_device); decode_forward returning
device tensors unless read_from_device; read_decode_output(async_read=True) -> (host, events).
"""
from __future__ import annotations

from typing import Any

from fakes.fake_ttnn import FakeTtnn


class FakeDeviceTensor:
    def __init__(self, rows: int) -> None:
        self.rows = rows


class FakeHostTensor:
    def __init__(self, rows: int) -> None:
        self.rows = rows


def make_model_class(ttnn: FakeTtnn, *, supports_async_decode: bool = True) -> type:
    recorder = ttnn.recorder

    class FakeTtModel:
        model_capabilities = {"supports_prefix_caching": True,
                              "supports_async_decode": supports_async_decode,
                              "supports_sample_on_device": True}

        def __init__(self, mesh_device: Any, max_batch_size: int) -> None:
            self.mesh_device = mesh_device
            self.max_batch_size = max_batch_size
            self.already_warmed_up_prefill = False

        @classmethod
        def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int,
                                  max_seq_len: int, n_layers: int | None = None,
                                  tt_data_parallel: int = 1, optimizations: str = "performance"):
            recorder.add("model.initialize_vllm_model", hf_config=hf_config, mesh_device=mesh_device,
                         max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         tt_data_parallel=tt_data_parallel, optimizations=optimizations)
            return cls(mesh_device, max_batch_size)

        def warmup_model_prefill(self, kv_cache: Any, enable_trace: bool, can_sample_on_device: bool,
                                 greedy_only: bool = False) -> None:
            if self.already_warmed_up_prefill:
                recorder.add("model.warmup_model_prefill.skipped", enable_trace=enable_trace)
                return
            self.already_warmed_up_prefill = True
            recorder.add("model.warmup_model_prefill", kv_cache=kv_cache, enable_trace=enable_trace,
                         can_sample_on_device=can_sample_on_device)

        def warmup_model_decode(self, kv_cache: Any, enable_trace: bool, max_batch_size: int,
                                num_blocks: int, can_sample_on_device: bool) -> None:
            recorder.add("model.warmup_model_decode", kv_cache=kv_cache, enable_trace=enable_trace,
                         max_batch_size=max_batch_size, num_blocks=num_blocks,
                         can_sample_on_device=can_sample_on_device)

        def prefill_forward(self, tokens: Any, page_table: Any = None, kv_cache: Any = None,
                            prompt_lens: Any = None, start_pos: Any = None, enable_trace: bool = True,
                            sampling_params: Any = None, empty_slots: Any = None) -> str:
            recorder.add("model.prefill_forward", enable_trace=enable_trace)
            return "prefill-out"

        def decode_forward(self, tokens: Any, start_pos: Any, page_table: Any = None,
                           kv_cache: Any = None, enable_trace: bool = True,
                           read_from_device: bool = True, sampling_params: Any = None,
                           reset_batch: bool = False) -> Any:
            recorder.add("model.decode_forward", tokens=tokens, enable_trace=enable_trace,
                         read_from_device=read_from_device, sampling_params=sampling_params)
            out = FakeDeviceTensor(self.max_batch_size)
            if read_from_device:
                return self.process_decode_output_host(self.read_decode_output(out),
                                                       is_tokens=sampling_params is not None)
            return out

        def read_decode_output(self, tt_out: FakeDeviceTensor, async_read: bool = False) -> Any:
            recorder.add("model.read_decode_output", async_read=async_read)
            host = FakeHostTensor(tt_out.rows)
            if not async_read:
                return host
            return host, [ttnn.record_event(self.mesh_device, 0), ttnn.record_event(self.mesh_device, 0)]

        def process_decode_output_host(self, tt_out: FakeHostTensor, is_tokens: bool = False) -> Any:
            recorder.add("model.process_decode_output_host", is_tokens=is_tokens)
            return ("tokens" if is_tokens else "logits", tt_out.rows)

    return FakeTtModel
