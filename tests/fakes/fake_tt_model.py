"""A tt-metal-style model that records how it is driven and computes deterministic tokens.

Signatures follow tt-metal's Generator (models/tt_transformers/tt/generator.py, the versions
that take `reset_batch`, as stored in the search index: ids 7625586423 and 66566430266, no commit
named) as the vLLM plugin calls it (vllm-tt-plugin @ e3fc849, model_runner.py, async_decode.py):
warmup_model_prefill(kv_cache, enable_trace, can_sample_on_device), guarded by
`already_warmed_up_prefill`; warmup_model_decode(kv_cache, enable_trace, max_batch_size,
num_blocks, can_sample_on_device); prefill_forward(tokens, page_table, kv_cache, prompt_lens,
start_pos, enable_trace, sampling_params, empty_slots); decode_forward(tokens, start_pos,
page_table, kv_cache, enable_trace, read_from_device, sampling_params, reset_batch) returning
device tensors unless read_from_device (the recorded `reset_batch` is None when the caller passed
none, which the model takes as False, the real default); read_decode_output(async_read=True) ->
(host, events) with one event per data-parallel group (the real one records
`ttnn.record_event(self.model[i].mesh_device, 0)` for each i in range(self.data_parallel); here
`data_parallel` is initialize_vllm_model's tt_data_parallel, 1 for a model built directly);
process_decode_output_host returning (tokens or logits, log-probs) as newer generators do.

What it models of the device, as tt-metal's generator and model do it:
- Tokens. The token after (token, position) is `next_token`; a row whose SamplingParams has a
  temperature above 0 adds the seed the device was given at its last `reset_batch`. Host
  sampling gets logits whose argmax (by a wide margin) is that token.
- Device-resident decode inputs (the legacy generator; `decode_contract` below replaces the
  inference with commands). A traced decode keeps one set of inputs per sampling mode
  (the trace's input tensors). With device sampling the sampled token is written into the token
  input and each position >= 0 advances by one, on the device. Host `tokens`/`start_pos` are
  copied in only when `reset_batch`, a prefill ran since the last decode, the step samples on
  the host, or the sampling mode changed; a changed page table alone refreshes only the page
  table. Each decode_forward call records where its inputs came from (`inputs`: "host",
  "device" or "device+page_table").
- The trace's output tensor is one buffer per sampling mode, overwritten by the next replay;
  read_decode_output snapshots it at the time of the call (the non-blocking read is enqueued
  on the command queue right behind the step).
- The paged KV cache (`kv`: (block id, offset) -> the token whose K/V sits there). A prefill
  writes every position it computes. A resumed prefill (start_pos > 0) is floored to the
  generator's alignment, lcm(block_size, q_chunk_size) with q_chunk_size 256 for a padded
  length of 2048 or more and 64 below (tt_transformers Generator.prefill_forward_text with
  model_config.py's SDPA_PROGCFG; models/common/model_capabilities.py floor_to_alignment), and
  recomputes from there: it reads `tokens` below start_pos and rewrites those positions.
- The device sampler keeps at most 32 candidates: tt-metal's format_sampling_params turns a
  top_k below 1 or above 32 into 32 (models/common/sampling); `clamped_top_k` lists the rows
  it did that to, which sample from another distribution than the one asked for.
- `token_feedback` is the model's `_tt_supports_decode_token_feedback` (tt-metal's models set it
  False where the sampled token cannot be written into the traced token input): without it a
  traced device-sampled decode advances its positions but leaves the token input as it was.
- `decode_contract=N` (N >= 1) mirrors the adapters that declare `decode_input_update_contract =
  N` (tt-metal models/common/decode_contract.py @ 40f4746; versions above 1 are supersets of 1,
  vllm-tt-plugin docs/DECODE_RELOAD_CONTRACT.md @ 1f10755). Each decode takes the four commands
  reload_inputs, reload_page_table, reload_sampling_params, reset_sampling_state and executes
  exactly them, inferring nothing (no sampling-mode, prefill or page-table checks of its own):
  the trace inputs (one set per sampling mode) are restaged only on reload_inputs, the page
  table alone on reload_page_table, else the decode runs on what they hold (a page table that
  differs from the host's is recorded as `model.stale_page_table`); sampling parameters are
  uploaded only on reload_sampling_params and seeds set only on it or reset_sampling_state, and
  a device-sampled decode samples with what was uploaded (`model.stale_sampling_params` when
  that is not what the call passed). It refuses (ValueError) what the contract refuses: the
  legacy `reset_batch` ("reset_batch is not part of the decode input-update contract ...") and
  reload_page_table together with reload_inputs (decode_contract.py); reload_inputs=False
  untraced ("Non-traced decode rebuilds ...") and, sampling on the device, on a model without
  token feedback ("... no on-device decode token feedback"), as tt-metal's Generator.decode_forward
  does in tt-metal's host test of the contract (search index file 60664309466); and
  reset_sampling_state without reload_inputs, or host sampling without reload_inputs, which the
  plugin's document (@ 1f10755) rules out ("reset_sampling_state implies reload_inputs"; host
  sampling "fully reloads forward inputs").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fakes.fake_ttnn import FakeTtnn

HOST_LOGIT = 30.0  # the target token's logit: sampling at any temperature picks it


def next_token(token: int, position: int, vocab_size: int) -> int:
    return (7 * token + 3 * position + 1) % vocab_size


class FakeDeviceTensor:
    """A device tensor: one value per row (token ids, or the target token of the logits)."""

    def __init__(self, values: list[int], is_tokens: bool) -> None:
        self.values, self.is_tokens = values, is_tokens

    @property
    def rows(self) -> int:
        return len(self.values)


class FakeHostTensor:
    def __init__(self, values: list[int]) -> None:
        self.values = list(values)

    @property
    def rows(self) -> int:
        return len(self.values)


@dataclass
class TraceInputs:
    tokens: list[int]
    positions: list[int]
    page_table: torch.Tensor | None


MAX_DEVICE_TOP_K = 32  # format_sampling_params' literal


def q_chunk_size(padded_len: int) -> int:
    """SDPA_PROGCFG's q_chunk_size for a prefill from offset 0 (model_config.py)."""
    return 256 if padded_len >= 2048 else 64


def make_model_class(ttnn: FakeTtnn, *, supports_async_decode: bool = True, vocab_size: int = 64,
                     takes_reset_batch: bool = True, decode_contract: int = 0, token_feedback: bool = True) -> type:
    recorder = ttnn.recorder

    class FakeTtModel:
        model_capabilities = {"supports_prefix_caching": True,
                              "supports_async_decode": supports_async_decode,
                              "supports_sample_on_device": True}
        _tt_supports_decode_token_feedback = token_feedback

        def __init__(self, mesh_device: Any, max_batch_size: int) -> None:
            self.mesh_device = mesh_device
            self.max_batch_size = max_batch_size
            self.vocab_size = vocab_size
            self.already_warmed_up_prefill = False
            self.mode: str | None = None
            self.trace_inputs: dict[bool, TraceInputs] = {}
            self.trace_output: dict[bool, FakeDeviceTensor] = {}
            self.prev_sampling_on_device: bool | None = None
            self.prev_page_table: torch.Tensor | None = None
            self.seeds: list[int | None] | None = None   # applied at the last reset_batch
            self.block_size: int | None = None
            self.kv: dict[tuple[int, int], int] = {}      # (block id, offset) -> token
            self.data_parallel = 1                        # one model per data-parallel submesh

        @classmethod
        def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int,
                                  max_seq_len: int, n_layers: int | None = None,
                                  tt_data_parallel: int = 1, optimizations: str = "performance"):
            recorder.add("model.initialize_vllm_model", hf_config=hf_config, mesh_device=mesh_device,
                         max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         tt_data_parallel=tt_data_parallel, optimizations=optimizations)
            model = cls(mesh_device, max_batch_size)
            model.data_parallel = tt_data_parallel
            return model

        def allocate_kv_cache(self, kv_cache_shape: tuple, dtype: Any, num_layers: int) -> list:
            recorder.add("model.allocate_kv_cache", kv_cache_shape=kv_cache_shape, dtype=dtype,
                         num_layers=num_layers)
            self.block_size = kv_cache_shape[2]
            return [["kv"] * num_layers]

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

        # ---- steps ----
        def _clamp_top_k(self, sampling_params: Any, rows: int) -> None:
            if sampling_params is None:
                return
            clamped = [row for row in range(rows) if _row(sampling_params.temperature, row) > 0
                       and not 1 <= _row(sampling_params.top_k, row) <= MAX_DEVICE_TOP_K]
            if clamped:
                recorder.add("model.clamped_top_k", rows=clamped)

        def _write_kv(self, tokens: torch.Tensor, page_table: torch.Tensor, start: int, end: int, row: int) -> int:
            """Writes positions [floor(start), end) of a prefill row; returns the floor."""
            if start > 0:
                alignment = math.lcm(self.block_size, q_chunk_size(tokens.shape[1]))
                start = (start // alignment) * alignment
            for pos in range(start, end):
                block = int(page_table[row, pos // self.block_size])
                self.kv[(block, pos % self.block_size)] = int(tokens[row, pos])
            return start

        def _sample(self, token: int, position: int, row: int, sampling_params: Any) -> int:
            target = next_token(token, position, self.vocab_size)
            if sampling_params is None or _row(sampling_params.temperature, row) <= 0:
                return target
            assert self.seeds is not None, "device sampling with a temperature before any reset_batch"
            return (target + (self.seeds[row] or 0)) % self.vocab_size

        def _logits(self, targets: list[int]) -> torch.Tensor:
            logits = torch.zeros(len(targets), 1, self.vocab_size)
            logits[torch.arange(len(targets)), 0, torch.tensor(targets)] = HOST_LOGIT
            return logits

        def prefill_forward(self, tokens: torch.Tensor, page_table: Any = None, kv_cache: Any = None,
                            prompt_lens: Any = None, start_pos: Any = None, enable_trace: bool = True,
                            sampling_params: Any = None, empty_slots: Any = None) -> torch.Tensor:
            recorder.add("model.prefill_forward", tokens=tokens.clone(), page_table=page_table.clone(),
                         prompt_lens=prompt_lens.tolist(), start_pos=start_pos.tolist(),
                         empty_slots=list(empty_slots), sampling_params=sampling_params,
                         enable_trace=enable_trace)
            self.mode = "prefill"
            ends = prompt_lens.tolist()
            if self.block_size is not None:
                floors = [self._write_kv(tokens, page_table, s, e, i)
                          for i, (s, e) in enumerate(zip(start_pos.tolist(), ends))]
                recorder.add("model.prefill_recomputed_from", floors=floors)
            self._clamp_top_k(sampling_params, len(ends))
            targets = [next_token(int(tokens[i, end - 1]), end - 1, self.vocab_size) for i, end in enumerate(ends)]
            if sampling_params is None:
                return self._logits(targets)
            if any(_row(sampling_params.temperature, i) > 0 for i in range(len(ends))):
                seeds = list(sampling_params.seed)
                targets = [(t + (seeds[i] or 0)) % self.vocab_size if _row(sampling_params.temperature, i) > 0
                           else t for i, t in enumerate(targets)]
            return torch.tensor(targets)

        def _decode_inputs(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: torch.Tensor,
                           enable_trace: bool, on_device: bool, reset_batch: bool) -> tuple[TraceInputs, str]:
            host = TraceInputs(tokens.reshape(-1).tolist(), start_pos.tolist(), page_table.clone())
            mode_switched = self.mode != "decode"
            self.mode = "decode"
            if not enable_trace:
                return host, "host"
            kept = self.trace_inputs.get(on_device)
            changed_mode = self.prev_sampling_on_device not in (None, on_device)
            self.prev_sampling_on_device = on_device
            page_table_changed = self.prev_page_table is None or not torch.equal(self.prev_page_table, page_table)
            self.prev_page_table = page_table.clone()
            if kept is None or reset_batch or mode_switched or not on_device or changed_mode:
                self.trace_inputs[on_device] = host
                return host, "host"
            if page_table_changed:
                kept.page_table = host.page_table
                return kept, "device+page_table"
            return kept, "device"

        def decode_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: Any = None,
                           kv_cache: Any = None, enable_trace: bool = True,
                           read_from_device: bool = True, sampling_params: Any = None,
                           reset_batch: bool | None = None) -> Any:
            on_device = sampling_params is not None
            self._clamp_top_k(sampling_params, tokens.shape[0])
            inputs, source = self._decode_inputs(tokens, start_pos, page_table, enable_trace, on_device,
                                                 bool(reset_batch))
            self._record_decode(tokens, start_pos, page_table, enable_trace, read_from_device, sampling_params,
                                reset_batch, source)
            if on_device and reset_batch:
                self.seeds = list(sampling_params.seed)
            return self._run_decode(inputs, enable_trace, read_from_device, on_device, sampling_params)

        def _record_decode(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: torch.Tensor,
                           enable_trace: bool, read_from_device: bool, sampling_params: Any,
                           reset_batch: bool | None, source: str) -> None:
            recorder.add("model.decode_forward", tokens=tokens.reshape(-1).tolist(), start_pos=start_pos.tolist(),
                         page_table=page_table.clone(), enable_trace=enable_trace,
                         read_from_device=read_from_device, sampling_params=sampling_params,
                         reset_batch=reset_batch, inputs=source)

        def _run_decode(self, inputs: TraceInputs, enable_trace: bool, read_from_device: bool, on_device: bool,
                        device_params: Any) -> Any:
            """Samples each row with the parameters the device holds (`device_params`)."""
            values = [self._sample(token, position, row, device_params) if position >= 0 else 0
                      for row, (token, position) in enumerate(zip(inputs.tokens, inputs.positions))]
            if enable_trace and on_device:
                if self._tt_supports_decode_token_feedback:
                    inputs.tokens = list(values)   # the sampler writes into the trace's token input
                inputs.positions = [p + 1 if p >= 0 else p for p in inputs.positions]
            if enable_trace:
                out = self.trace_output.setdefault(on_device, FakeDeviceTensor([], on_device))
                out.values = values           # one output buffer per trace, overwritten each replay
            else:
                out = FakeDeviceTensor(values, on_device)
            if read_from_device:
                return self.process_decode_output_host(self.read_decode_output(out), is_tokens=on_device)
            return out

        def read_decode_output(self, tt_out: FakeDeviceTensor, async_read: bool = False) -> Any:
            recorder.add("model.read_decode_output", async_read=async_read)
            host = FakeHostTensor(tt_out.values)
            if not async_read:
                return host
            return host, [ttnn.record_event(self.mesh_device, 0) for _ in range(self.data_parallel)]

        def process_decode_output_host(self, tt_out: FakeHostTensor, is_tokens: bool = False) -> Any:
            recorder.add("model.process_decode_output_host", is_tokens=is_tokens)
            out = torch.tensor(tt_out.values).reshape(-1, 1) if is_tokens else self._logits(tt_out.values)
            return out, torch.ones(out.shape[0])

    if decode_contract >= 1:
        class ContractFakeTtModel(FakeTtModel):
            """An adapter of the decode input-update contract, version `decode_contract`."""
            decode_input_update_contract = decode_contract

            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.device_params: Any = None   # uploaded at the last reload_sampling_params

            def decode_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: Any = None,
                               kv_cache: Any = None, enable_trace: bool = True, read_from_device: bool = True,
                               sampling_params: Any = None, *, reload_inputs: bool, reload_page_table: bool,
                               reload_sampling_params: bool, reset_sampling_state: bool, **kwargs: Any) -> Any:
                name = type(self).__name__
                on_device = sampling_params is not None
                if "reset_batch" in kwargs:  # decode_contract.reject_legacy_reload_signal
                    raise ValueError(f"reset_batch is not part of the decode input-update contract; the vLLM "
                                     f"build driving {name} predates it. Upgrade the vLLM pin to a "
                                     "build that sends reload_inputs / reload_page_table / "
                                     "reload_sampling_params / reset_sampling_state.")
                if reload_inputs and reload_page_table:  # decode_contract.decode_input_staging
                    raise ValueError("reload_page_table is the page-table-only copy and is meaningless with "
                                     "reload_inputs=True, which already restages page tables")
                if not reload_inputs:
                    if reset_sampling_state:
                        raise ValueError("reset_sampling_state needs authoritative tokens and positions "
                                         "(reload_inputs=True)")
                    if not enable_trace:
                        raise ValueError("Non-traced decode rebuilds every input from the host; it "
                                         "requires reload_inputs=True")
                    if not on_device:
                        raise ValueError("host sampling requires authoritative tokens and positions "
                                         "(reload_inputs=True)")
                    if not self._tt_supports_decode_token_feedback:
                        raise ValueError(f"{name} has no on-device decode token feedback, so a decode on its "
                                         "resident inputs would replay the previous token; it requires "
                                         "reload_inputs=True")
                recorder.add("model.decode_commands", reload_inputs=reload_inputs,
                             reload_page_table=reload_page_table, reload_sampling_params=reload_sampling_params,
                             reset_sampling_state=reset_sampling_state)
                self._clamp_top_k(sampling_params, tokens.shape[0])
                self.mode = "decode"
                host = TraceInputs(tokens.reshape(-1).tolist(), start_pos.tolist(), page_table.clone())
                if not enable_trace or reload_inputs:
                    inputs, source = host, "host"
                    if enable_trace:
                        self.trace_inputs[on_device] = host
                else:
                    inputs = self.trace_inputs.get(on_device)
                    assert inputs is not None, "reload_inputs=False before any inputs were staged in this trace"
                    source = "device"
                    if reload_page_table:
                        inputs.page_table, source = host.page_table, "device+page_table"
                    elif not torch.equal(inputs.page_table, host.page_table):
                        recorder.add("model.stale_page_table")  # the trace reads the old block table
                self._record_decode(tokens, start_pos, page_table, enable_trace, read_from_device, sampling_params,
                                    None, source)
                if on_device and reload_sampling_params:
                    self.device_params = sampling_params
                if on_device and (reload_sampling_params or reset_sampling_state):
                    self.seeds = list(sampling_params.seed)
                if on_device and self.device_params != sampling_params:
                    recorder.add("model.stale_sampling_params", uploaded=self.device_params, passed=sampling_params)
                return self._run_decode(inputs, enable_trace, read_from_device, on_device,
                                        self.device_params if on_device else None)

        return ContractFakeTtModel

    if takes_reset_batch:
        return FakeTtModel

    class OlderFakeTtModel(FakeTtModel):
        """A generator from before `reset_batch`."""

        def decode_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: Any = None,
                           kv_cache: Any = None, enable_trace: bool = True,
                           read_from_device: bool = True, sampling_params: Any = None) -> Any:
            return super().decode_forward(tokens, start_pos, page_table, kv_cache, enable_trace,
                                          read_from_device, sampling_params)

    return OlderFakeTtModel


def _row(value: Any, row: int) -> Any:
    return value[row] if isinstance(value, list) else value
