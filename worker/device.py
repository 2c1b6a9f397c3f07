"""The device interface: everything the runner (worker/runner.py) asks of a backend.

The runner speaks tt-metal's generator contract (models/tt_transformers/tt/generator_vllm.py and
generator.py: `initialize_vllm_model`, `allocate_kv_cache`, `warmup_model_prefill/decode`,
`prefill_forward`, `decode_forward(read_from_device=False)` -> `read_decode_output(async_read=True)`
-> `process_decode_output_host`); a backend says how those calls reach its device and states the
rules of its model classes, so that the runner holds none of them. The backends
(worker/backends/): `TorchBackend` (torch reference models, and the simulated mesh's model) and
`TtnnBackend` (tt-metal's classes on a ttnn mesh).

Units and ownership, for every member: rows are the whole device's decode rows (lanes x
`max_num_seqs`, lane-major); positions and lengths are in tokens, page tables in block ids. Tensors
a backend returns are torch tensors the caller owns and may keep across steps (on the host, but
for the torch backend's prefill output, which stays on its torch device). Tensors the runner
passes stay the runner's: a backend fills a decode's carried rows into its `tokens`, and copies
whatever it keeps beyond the call.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from .batch import ServingConfig
    from .sampling import SamplingBatch

Progress = Callable[[str, int, int, str], None]  # phase, completed, total, detail


@dataclass(slots=True)
class PendingDecode:
    """A decode launched on the device whose result has not been taken yet: what
    `decode_forward(read_from_device=False)` returned and the non-blocking readback that
    `read_decode_output(async_read=True)` started. The backend that launched it finishes it, and
    processes its readback exactly once (a second `process_decode_output_host` of one submission
    corrupts it: the plugin's async_decode.py `finalize_decode`)."""
    device_out: Any      # decode_forward's output on the device (torch: the step's tokens by row); None: not kept
    host_out: Any        # the host tensors the readback fills
    events: list[Any]    # to wait for before host_out is complete
    is_tokens: bool      # sampled on the device (token ids), else logits
    result: Any = None   # the processed host result, once read back
    read: bool = False   # read back: `result` holds it


class DeviceBackend(Protocol):
    """How the runner's calls reach one kind of device, and the rules of its model classes."""

    @property
    def resident_tokens(self) -> bool:
        """A decode may take the previous decode's tokens while that decode is still on the device
        (its `PendingDecode` passed as `launch_decode`'s `previous`). The runner pipelines decodes
        (two in flight: async decode) only when this holds. Known once `initialize` returned."""
        ...

    @property
    def null_block(self) -> bool:
        """Device block 0 is kept out of every request's table: the model's padding (positions
        past a prompt, through a zero-padded page table) writes KV there, as vLLM keeps block 0
        as its null block for the TT plugin. The runner then shifts the control plane's block
        ids by one and allocates one block more than it reports."""
        ...

    @property
    def vision_prefill_samples_on_host(self) -> bool:
        """A vision-language model's prefill returns logits whatever `sampling_params` asks, so its
        prefill batches are sampled on the host (tt-metal's qwen25_vl/qwen3_vl generator_vllm.py
        `prefill_forward` drops sampling_params)."""
        ...

    def lanes_in_process(self, model_cls: type) -> bool:
        """Every lane (data-parallel KV cache) steps in this worker's one model, in one batch of
        lanes x max_num_seqs rows; False: the class serves one lane per worker (process)."""
        ...

    def max_top_k(self, capabilities: Mapping[str, Any]) -> int | None:
        """The largest top_k the device sampler honours exactly (rows asking more are sampled on
        the host); None: no limit. `capabilities` is the class's `model_capabilities`."""
        ...

    def max_prefill_users(self, model_cls: type, images: bool) -> int | None:
        """The most users one `prefill_forward` call may carry (None: a lane's rows); `images`:
        the checkpoint is a vision-language model."""
        ...

    def check(self, model_cls: type, model_path: Path, config: ServingConfig) -> None:
        """Raises ValueError, before any weight loads or device opens, for a serving
        configuration the class would refuse (its asserts in `initialize_vllm_model`)."""
        ...

    def kv_tokens_per_lane(self, model_cls: type, model_path: Path, config: ServingConfig,
                           block_size: int) -> int | None:
        """KV cache tokens per lane when the device or the class fixes them (tt-metal:
        `get_max_tokens_all_users`); None: the runner sizes the cache from its byte budget."""
        ...

    def initialize(self, model_cls: type, model_path: Path, hf_config: dict, config: ServingConfig) -> Any:
        """Opens the device if needed and builds the model: `model_cls.initialize_vllm_model(
        hf_config, device, max_batch_size, max_seq_len, tt_data_parallel=...)`. Returns the model,
        which the runner holds until `close`."""
        ...

    def verifies_drafts(self, model_cls: type) -> bool:
        """Decode rows of this class may carry draft tokens (speculative decoding), which
        `verify` scores."""
        ...

    def hybrid_kv_cache(self, model_cls: type) -> bool:
        """The class takes hybrid KV cache groups (worker/kv_groups.py): a page table per layer
        (`page_tables_per_layer`, with every step) and layers sharing KV buffers
        (`allocate_kv_cache_per_layer`)."""
        ...

    def allocate_kv_cache(self, model: Any, num_blocks: int, num_kv_heads: int, block_size: int,
                          head_dim: int, num_layers: int, num_lanes: int,
                          tensor_of_layer: Sequence[int] | None = None) -> Any:
        """The model's paged KV cache: `model.allocate_kv_cache(shape, dtype, num_layers)` (or
        `allocate_kv_cache_per_layer`), `num_blocks` blocks of `block_size` tokens per lane. With
        hybrid KV groups, `tensor_of_layer` names each layer's shared buffer. The runner holds
        the returned cache and passes it back to every step."""
        ...

    def warmup(self, model: Any, kv_cache: Any, config: ServingConfig, page_table_width: int,
               progress: Progress) -> None:
        """`warmup_model_prefill` and `warmup_model_decode`: every shape compiled untraced first,
        then the traced ones captured. `page_table_width` is every step's page table width in
        blocks (tt-metal's `num_blocks`); `progress` gets each shape under its phase."""
        ...

    def sampling_params(self, batch: SamplingBatch, seeds: list[int | None]) -> Any:
        """The `sampling_params` argument of a device-sampled step: one entry per row of `batch`,
        `seeds` the rows' seeds (None: a row without one)."""
        ...

    def prefill(self, model: Any, rope_deltas: bool = False, **inputs: Any) -> Any:
        """`prefill_forward(tokens, page_table, kv_cache, prompt_lens, start_pos, sampling_params,
        empty_slots[, pixel_values, image_grid_thw])` with the backend's prefill trace flag.
        Row i of `tokens` holds the request's real tokens from position 0; `prompt_lens[i]` is the
        chunk's end and `start_pos[i]` what is cached. Returns token ids [users] when
        `sampling_params` is given, else logits ([users, vocab] or [users, 1, vocab]); with
        `rope_deltas` (an mRoPE model) the pair (that output, rope deltas [users])."""
        ...

    def launch_decode(self, model: Any, sampling_params: Any, *, tokens: torch.Tensor, start_pos: torch.Tensor,
                      page_table: torch.Tensor, kv_cache: Any, previous: torch.Tensor | PendingDecode | None = None,
                      carried_rows: Sequence[int] = (), **inputs: Any) -> PendingDecode:
        """Starts one decode step over every row: `decode_forward(tokens [rows, 1], start_pos
        [rows] (-1: an empty row), page_table [rows, width], kv_cache, sampling_params,
        read_from_device=False)` then `read_decode_output(async_read=True)`; `inputs` are the
        model's extra decode inputs (`rope_deltas_all_users`). `carried_rows` take the token the
        previous decode sampled: `previous` is that decode's host tokens by row, or its
        `PendingDecode` while it is still on the device (only when `resident_tokens`); their
        `tokens` entries are placeholders. Returns before the step completes."""
        ...

    def finish_decode(self, model: Any, pending: PendingDecode) -> Any:
        """Waits for `pending`'s readback and returns `process_decode_output_host`'s result: token
        ids (one per row) when it sampled on the device, else logits [rows, vocab] (or [rows, 1,
        vocab]). Called once per launched decode, in launch order."""
        ...

    def verify(self, model: Any, **inputs: Any) -> Any:
        """Speculative decoding's verify step, one forward over some decode rows: `verify_forward(
        tokens [B, S], start_pos [B], page_table [B, width], kv_cache, num_tokens [B], empty_slots [B][,
        page_tables_per_layer, rope_deltas_all_users])`, row i computing tokens[i, :num_tokens[i]]
        (its fed token, then its draft tokens) from position start_pos[i], as batch row
        empty_slots[i]. Returns float32 logits [B, S, vocab] of every position, never tokens: a
        verify step samples on the host. The runner calls it only where `verifies_drafts`."""
        ...

    def reset(self) -> None:
        """A new step stream: nothing the device holds of the last one (decode inputs, rows) is
        reused. The runner has finished every decode it launched before calling this."""
        ...

    def close(self) -> None:
        """Releases the device (a mesh, its fabric); the runner has dropped the model first."""
        ...
