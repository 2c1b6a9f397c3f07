"""Mirrors tt-metal models/demos/llama3_70b_galaxy/tt/generator.py (`Generator`, the base of the
Galaxy vLLM adapters in generator_vllm.py): prefill as of the stored version @ 00b0fa3f57bf8c13af0f124a70a02b0bdbde8b90
(code index id 55230135512), decode as the newest Galaxy generator speaks it: the decode
input-update contract (models/common/decode_contract.py @ 40f4746e27acded3f2eaf7307bd1c3a2a86f7add),
which tt-metal's host test of the contract (search index file 60664309466,
test_the_base_generators_advertise_the_contract / test_the_legacy_reset_batch_signal_is_rejected /
test_galaxy_generator_stages_only_what_the_commands_request) pins on this very class. The
stored 00b0fa3 still took `reset_batch`/`reset_inputs` and reloaded every input on any page-table
change; that generator is not modelled here (a pre-contract caller is refused, as the newest does).

What ttserve's worker calls, as the real class does it:
- `warmup_model_prefill(kv_cache, enable_trace, can_sample_on_device,
  non_greedy_decoding_on_device)` always runs `prefill_warmup` (no `already_warmed_up_prefill`
  guard of its own; `prefill_warmup` sets the flag). The warmup asserts every prefix-caching length
  `SDPA_CHUNK_ALIGN + L` (L = 128 and the powers of two from 1024 up to max_seq_len) is a
  multiple of the KV block size ("total_seq_len (...) must be aligned to block_size (...)"), so
  only block sizes dividing 128 warm up.
- `prefill_forward_text` (the adapters' `prefill_forward`) runs `prefill_warmup` first when no
  warmup ran yet (recorded as `model.prefill_warmup` with lazy=True). A resumed row's start_pos
  (the cached-prefix length) is floored to SDPA_CHUNK_ALIGN = 128 (model_config.py), not to a
  block or q-chunk lcm as tt_transformers does; then `_should_skip_prefix_caching` may drop the
  prefix altogether (num_cached = 0: recompute from position 0) when the padded new length is not
  small enough against the padded total. With a page table, every raw start_pos must be a multiple
  of the block size ("start_pos must be aligned to block_size"). The row is padded to
  `get_padded_prefill_len(seq_len - num_cached)` (128, 1024, then powers of two) and the KV of every
  computed position, padding included (paged_fill_cache of the whole padded chunk, llama_attention.py),
  goes through the row's page table cut to the padded length and padded with block 0
  (`_get_prefill_user_page_table`): positions past the prompt land in whatever blocks the row's
  table holds there, block 0 past its width. `model.prefill_padding_blocks` lists, per row, the
  blocks only padding was written to.
- `decode_forward`: the contract's four commands, keyword-only with the host-authoritative
  defaults (reload_inputs=True, the other three False), executed exactly (fakes/fake_tt_model.py's
  ContractFakeTtModel: no page-table comparison, no sampling-mode or prefill inference of its
  own); `reset_batch` is refused ("... predates it").
- `read_decode_output(tt_out, async_read=True)` returns ((output, log-probs), [one read event])
  and `process_decode_output_host(tt_out, is_tokens=True)` takes that pair: tokens come back as
  one row of ids, logits as [rows, 1, vocab].
- `warmup_model_decode` is models/common/warmup.py's WarmupForwardMixin's (kv_cache, enable_trace,
  max_batch_size, num_blocks, can_sample_on_device, non_greedy_decoding_on_device).
No `get_max_tokens_all_users` (the class is no ModelCapabilitiesMixin).
"""
from __future__ import annotations

import math
from typing import Any

import torch

from fakes.fake_tt_model import FakeHostTensor, make_model_class

from models.tt_transformers.tt.generator import TTNN

SDPA_CHUNK_ALIGN = 128  # models/demos/llama3_70b_galaxy/tt/model_config.py, imported by the real module
PAD_TOKEN = 0           # prefill_ids are padded with zeros

_ContractGenerator = make_model_class(TTNN, decode_contract=1)


def get_prefill_warmup_sequence_lengths(max_seq_len: int) -> list[int]:
    return [128] + [2 ** i for i in range(10, max_seq_len.bit_length()) if 2 ** i <= max_seq_len]


def get_padded_prefill_len(seq_len: int) -> int:
    if seq_len <= 128:
        return 128
    if seq_len <= 1024:
        return 1024
    return 2 ** (seq_len - 1).bit_length()


def _should_skip_prefix_caching(seq_len: int, num_cached: int) -> bool:
    """The real heuristic: recompute everything when the padded new length saves too little."""
    if num_cached == 0:
        return False
    padded_new, padded_total = get_padded_prefill_len(seq_len - num_cached), get_padded_prefill_len(seq_len)
    if padded_new >= padded_total:
        return True
    ratio = padded_new / padded_total
    if ratio <= 0.125:
        return False
    if ratio <= 0.25:
        return padded_total > 32768
    if ratio <= 0.5:
        return padded_total > 16384
    return True


def num_cached_tokens(start_pos: int, seq_len: int) -> int:
    """Where a row's prefill really starts: floored to SDPA_CHUNK_ALIGN, then maybe 0."""
    aligned = (start_pos // SDPA_CHUNK_ALIGN) * SDPA_CHUNK_ALIGN if start_pos > 0 else 0
    return 0 if _should_skip_prefix_caching(seq_len, aligned) else aligned


class Generator(_ContractGenerator):
    max_seq_len = 131072  # the model args' (set by initialize_vllm_model)

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              n_layers: int | None = None, tt_data_parallel: int = 1,
                              optimizations: Any = None) -> Any:
        model = super().initialize_vllm_model(hf_config, mesh_device, max_batch_size, max_seq_len, n_layers,
                                              tt_data_parallel, optimizations)
        model.max_seq_len = max_seq_len
        return model

    # ---- prefill ----
    def warmup_model_prefill(self, kv_cache: Any, enable_trace: bool, can_sample_on_device: bool,
                             non_greedy_decoding_on_device: bool) -> None:
        TTNN.recorder.add("model.warmup_model_prefill", kv_cache=kv_cache, enable_trace=enable_trace,
                          can_sample_on_device=can_sample_on_device)
        self.prefill_warmup(kv_cache, enable_trace, lazy=False)

    def prefill_warmup(self, kv_cache: Any, enable_trace: bool, *, lazy: bool) -> None:
        self.already_warmed_up_prefill = True
        block_size = self.block_size if kv_cache else 64
        lengths = get_prefill_warmup_sequence_lengths(self.max_seq_len)
        TTNN.recorder.add("model.prefill_warmup", enable_trace=enable_trace, lazy=lazy, lengths=lengths)
        for length in lengths:  # phase 2: one prefix-cached (sp1) trace per length
            total = SDPA_CHUNK_ALIGN + length
            assert total % block_size == 0, f"total_seq_len ({total}) must be aligned to block_size ({block_size})"

    def prefill_forward_text(self, tokens: torch.Tensor, page_table: Any = None, kv_cache: Any = None,
                             prompt_lens: Any = None, enable_trace: bool = True, sampling_params: Any = None,
                             empty_slots: Any = None, tt_out_logits_all_users: Any = None,
                             prompt_tokens: Any = None, output_tokens: Any = None, start_pos: Any = None) -> Any:
        if not self.already_warmed_up_prefill:
            self.prefill_warmup(kv_cache, enable_trace, lazy=True)
        batch, width = tokens.shape
        prompt_lens = torch.as_tensor(prompt_lens if prompt_lens is not None else [width] * batch)
        start_pos = torch.as_tensor(start_pos if start_pos is not None else [0] * batch)
        if page_table is not None and self.block_size is not None:
            assert all(int(s) % self.block_size == 0 for s in start_pos), "start_pos must be aligned to block_size"
        if empty_slots is None:
            empty_slots = list(range(batch))
        # The recording fake's prefill (the adapters' own prefill_forward calls back into this one).
        return super().prefill_forward(tokens, page_table, kv_cache, prompt_lens, start_pos, enable_trace,
                                       sampling_params, empty_slots)

    def _write_kv(self, tokens: torch.Tensor, page_table: torch.Tensor, start: int, end: int, row: int) -> int:
        """Writes the padded chunk [num_cached, num_cached + padded) of a row; returns num_cached."""
        bs = self.block_size
        cached = num_cached_tokens(start, end)
        if cached:
            assert cached % bs == 0, f"num_cached_tokens ({cached}) must be aligned to block_size ({bs})."
        padded_end = cached + get_padded_prefill_len(end - cached)
        blocks = math.ceil(padded_end / bs)
        table = page_table[row, :blocks].tolist()
        table += [0] * (blocks - len(table))          # _get_prefill_user_page_table's zero padding
        padding_only = []
        for pos in range(cached, padded_end):
            block = table[pos // bs]
            if block < 0:
                continue
            self.kv[(block, pos % bs)] = int(tokens[row, pos]) if pos < end else PAD_TOKEN
            if pos // bs >= math.ceil(end / bs) and block not in padding_only:
                padding_only.append(block)
        TTNN.recorder.add("model.prefill_padding_blocks", row=row, blocks=padding_only)
        return cached

    # ---- decode ----
    def warmup_model_decode(self, kv_cache: Any, enable_trace: bool, max_batch_size: int, num_blocks: int,
                            can_sample_on_device: bool, non_greedy_decoding_on_device: bool) -> None:
        super().warmup_model_decode(kv_cache, enable_trace, max_batch_size, num_blocks, can_sample_on_device)

    def decode_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: Any = None,
                       kv_cache: Any = None, enable_trace: bool = True, read_from_device: bool = True,
                       async_read: bool = False, sampling_params: Any = None, *, reload_inputs: bool = True,
                       reload_page_table: bool = False, reload_sampling_params: bool = False,
                       reset_sampling_state: bool = False, prompt_tokens: Any = None, output_tokens: Any = None,
                       slot_remap: Any = None, **kwargs: Any) -> Any:
        out = super().decode_forward(tokens, start_pos, page_table, kv_cache, enable_trace, False, sampling_params,
                                     reload_inputs=reload_inputs, reload_page_table=reload_page_table,
                                     reload_sampling_params=reload_sampling_params,
                                     reset_sampling_state=reset_sampling_state, **kwargs)
        if not read_from_device:
            return out
        host = self.read_decode_output(out, async_read=async_read)
        return host if async_read else self.process_decode_output_host(host, is_tokens=sampling_params is not None)

    def read_decode_output(self, tt_out: Any, async_read: bool = True) -> Any:
        TTNN.recorder.add("model.read_decode_output", async_read=async_read)
        host = (FakeHostTensor(tt_out.values), None)
        if not async_read:
            return host
        return host, [TTNN.record_event(self.mesh_device, 0)]

    def process_decode_output_host(self, tt_out: Any, is_tokens: bool = True) -> Any:
        TTNN.recorder.add("model.process_decode_output_host", is_tokens=is_tokens)
        host, log_probs = tt_out if isinstance(tt_out, tuple) else (tt_out, None)
        out = torch.tensor(host.values) if is_tokens else self._logits(host.values)
        return out, log_probs if log_probs is not None else torch.ones(out.shape[0])
