"""Drives a model through the generator contract: turns step batches into model calls.

The runner owns the per-request device state for the life of one step stream (row, block
table, sampling parameters, random generator) so each step carries only deltas, the KV cache
tensors for the life of the process, and the decode pipeline (the decodes launched ahead, and
what feeds the next decode's carried rows). How calls reach the device, and the rules of the
model classes, are the backend's (worker/device.py's DeviceBackend): nothing here is specific to
one kind of device.
"""
from __future__ import annotations

import json
import functools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .batch import (DecodeItem, GroupBlocks, HostSampling, ImageInput, NewRequest, PrefillChunk, ServingConfig,
                    StepBatch, StepResult, TokenLogprobs)
from .device import DeviceBackend, PendingDecode, Progress
from .kv_groups import KvGroups, group_layers, uniform
from .planning.options import async_decode_allowed, device_sampling, trace_flags
from .planning.registry import mixture_of_experts
from .sampling import SamplingBatch, draws, gather_logprobs, sample, seeded_generator, verify, verify_logprobs
from .step_check import Limits, check_batch

log = logging.getLogger(__name__)


class StepError(RuntimeError):
    """A step batch the runner cannot execute (a control-plane bug or a device failure)."""


@dataclass(slots=True)
class RequestState:
    row: int
    temperature: float
    top_p: float
    top_k: int
    generator: torch.Generator | None
    seed: int | None = None
    min_tokens: int = 0
    min_tokens_blocked_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0     # sampled so far, including before a preemption
    block_ids: list[int] = field(default_factory=list)
    # Per KV group past the first: the entries of its table so far (skipped ones too), which
    # always matches len(block_ids) after a step's item (step_check.py).
    group_lengths: list[int] = field(default_factory=list)
    # The request's tokens from position 0 up to where its prefill has reached: a tt-metal
    # generator floors a resumed prefill's start to its alignment and recomputes from there, so
    # every prefill row carries the real tokens before start_pos. Emptied once the prompt is in.
    prefix: list[int] = field(default_factory=list)
    # Options only the host sampler applies, with the token history they read; None: none.
    # A resumed request arrives as a new NewRequest with its whole history, never appended to.
    host: HostSampling | None = None
    # The images the control plane has sent for this device state, in prompt order: each is
    # sent once (with the chunk that covers it) and kept, since every later chunk's positions
    # depend on the grids of the images before it; once computed, only its grid is kept.
    images: list[ImageInput] = field(default_factory=list)
    # mRoPE models: decode position = sequence position + this (the model's prefill says).
    rope_delta: int = 0

    @property
    def blocked_token_ids(self) -> list[int] | None:
        return self.min_tokens_blocked_ids if self.num_output_tokens < self.min_tokens else None

    @property
    def needs_host_sampler(self) -> bool:
        return bool(self.blocked_token_ids) or self.host is not None

    def sampled(self, token_id: int) -> None:
        self.num_output_tokens += 1
        if self.host is not None:
            self.host.output_token_ids.append(token_id)


@dataclass(slots=True)
class Launched:
    """A step started on the device; `pending` is set while a decode's result is still there."""
    result: StepResult
    started: float
    received: float                         # when its batch arrived (perf_counter)
    pending: PendingDecode | None = None    # a pipelined decode's, until finish()
    items: list[DecodeItem] = field(default_factory=list)  # that decode's items

    @property
    def deferred(self) -> bool:
        return self.pending is not None


@dataclass(slots=True, frozen=True)
class DeviceOptions:
    """How the runner drives the device: the validated `tt` options (worker/planning/options.py) plus
    what the backend can do."""
    tt: dict = field(default_factory=dict)
    backend_traces: bool = False              # the backend runs trace shapes (ttnn, sim, torch)
    kv_tokens_per_lane: int | None = None     # KV budget fixed by the device, not by bytes
    # Step kinds the backend can trace: torch traces decode only (a CUDA graph, or on a CPU the
    # same static shapes run eagerly); prefill lengths vary too much to capture.
    traced_kinds: frozenset[str] = frozenset({"prefill", "decode"})

    def traced(self, kind: str) -> bool:
        if not self.backend_traces or kind not in self.traced_kinds:
            return False
        flags = trace_flags(self.tt)
        return flags.prefill if kind == "prefill" else flags.decode

    def device_sampling(self, kind: str) -> bool:
        return device_sampling(self.tt, kind)

    @property
    def warmup(self) -> bool:
        return self.tt.get("enable_model_warmup", True)


@dataclass(slots=True, frozen=True)
class KvLayout:
    num_blocks_per_lane: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # Tensors a layer caches per token and head: K and V (2), or one compressed latent (1) for
    # multi-head latent attention (DeepSeek V2/V3's MLA caches [kv_lora_rank | qk_rope_head_dim]).
    tensors_per_layer: int
    # The layers' KV groups (worker/kv_groups.py): one group of every layer unless the class
    # reads a page table per layer; a block holds kv_groups.group_size layers.
    kv_groups: KvGroups


def latent_attention(hf_config: dict) -> bool:
    """Whether the checkpoint uses multi-head latent attention (MLA), as vLLM decides it: a
    config declaring `kv_lora_rank` (vLLM's `use_mla` for its Transformers backend; its native rule,
    `is_deepseek_mla`, also asks for one of the DeepSeek-like model types, which all declare it)."""
    return hf_config.get("kv_lora_rank") is not None


class ModelRunner:
    def __init__(self, model_path: Path, model_cls: type, architecture: str, backend: DeviceBackend,
                 dtype: torch.dtype, block_size: int, kv_cache_bytes: int,
                 options: DeviceOptions | None = None) -> None:
        self.options = options or DeviceOptions()
        self.backend = backend  # how model calls reach the device (worker/backends/)
        self.model_path = model_path
        self.model_cls = model_cls
        self.architecture = architecture
        self.dtype = dtype
        self.block_size = block_size
        self.kv_cache_bytes = kv_cache_bytes
        self.hf_config: dict = self.read_config(model_path)
        self.config: ServingConfig | None = None
        self.layout: KvLayout | None = None
        # Device blocks kept out of every table (DeviceBackend.null_block): the control plane's
        # block id b is device block b + this.
        self._null_blocks = int(self.backend.null_block)
        self.model = None
        self.kv_cache = None
        self._requests: dict[str, RequestState] = {}
        # The decode pipeline. Pipelined decodes launched and not yet finished (at most one in
        # steady decode), and the last decode's tokens by row for the rows that carry them into
        # the next step: host tokens, or while that decode was pipelined its PendingDecode (the
        # backend takes the tokens from the device, or reads it back first).
        self._deferred: list[Launched] = []
        self._previous_tokens: torch.Tensor | PendingDecode = torch.zeros(0, dtype=torch.long)

    # ---- model facts ---------------------------------------------------------------------
    @staticmethod
    def read_config(model_path: Path) -> dict:
        """config.json, with a vision-language model's text_config (transformers 5 nests the
        language model's shape there) also read at the top level, where its fields would be in
        a text-only checkpoint."""
        config = json.loads((model_path / "config.json").read_text())
        text = config.get("text_config")
        return {**config, **text} if isinstance(text, dict) else config

    @property
    def supports_images(self) -> bool:
        """A vision-language model (its checkpoint has a vision tower)."""
        return "vision_config" in self.hf_config

    @property
    def image_token_id(self) -> int:
        c = self.hf_config
        return int(c.get("image_token_id", c.get("image_token_index", 0)) or 0)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def max_position_embeddings(self) -> int:
        return int(self.hf_config.get("max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> list[int]:
        ids: list[int] = []
        for source in (self.hf_config, self._generation_config()):
            eos = source.get("eos_token_id")
            for token in eos if isinstance(eos, list) else [eos]:
                if token is not None and token not in ids:
                    ids.append(int(token))
        return ids

    def _generation_config(self) -> dict:
        path = self.model_path / "generation_config.json"
        return json.loads(path.read_text()) if path.exists() else {}

    @property
    def is_mixture_of_experts(self) -> bool:
        return mixture_of_experts(self.hf_config)

    @property
    def uses_mrope(self) -> bool:
        rope = self.hf_config.get("rope_scaling") or self.hf_config.get("rope_parameters") or {}
        return "mrope_section" in rope or rope.get("type") == "mrope" or rope.get("rope_type") == "mrope"

    @functools.cached_property
    def capabilities(self) -> dict[str, bool]:
        # tt-metal's classes may not declare any (as vLLM's plugin allows): then none.
        return dict(getattr(self.model_cls, "model_capabilities", None) or {})

    @functools.cached_property
    def lanes_in_process(self) -> bool:
        """All lanes run in this worker's one model (the control plane may give it several)."""
        return self.backend.lanes_in_process(self.model_cls)

    @functools.cached_property
    def supports_speculative_decoding(self) -> bool:
        """Decode rows may carry draft tokens (device.proto DecodeItem.draft_token_ids), which the
        backend's `verify` scores: its decision (the torch reference models and the sim's
        `verify_forward`; no mesh class today, backends/ttnn/backend.py says why)."""
        return self.backend.verifies_drafts(self.model_cls)

    @functools.cached_property
    def _device_top_k(self) -> int | None:
        """The largest top_k the device sampler honours exactly (None: no limit)."""
        return self.backend.max_top_k(self.capabilities)

    # ---- warmup --------------------------------------------------------------------------
    def warmup(self, config: ServingConfig, progress: Progress) -> None:
        if self.config is not None:
            if config != self.config:
                raise ValueError(f"this worker is already serving {self.config}; refusing a second "
                                 f"configuration {config}: restart the worker to change it")
            return
        # An impossible configuration or KV budget is refused before minutes of weight loading.
        self.backend.check(self.model_cls, self.model_path, config)
        layout = self.kv_layout(config)
        progress("load", 0, 1, f"{self.architecture} from {self.model_path}")
        self.model = self.backend.initialize(self.model_cls, self.model_path, self.hf_config, config)
        progress("load", 1, 1, "weights loaded")
        self.layout = layout
        progress("allocate", 0, 1, f"{layout.num_blocks_per_lane} blocks x {self.block_size} "
                 f"tokens per lane, {config.num_lanes} lane(s)")
        groups = layout.kv_groups
        self.kv_cache = self.backend.allocate_kv_cache(
            self.model, layout.num_blocks_per_lane + self._null_blocks, layout.num_kv_heads, self.block_size, layout.head_dim,
            layout.num_layers, config.num_lanes, groups.tensor_of_layer if groups.hybrid else None)
        progress("allocate", 1, 1, "KV cache allocated")
        # Page-table width: what a max_model_len sequence needs, and never more blocks than a
        # lane holds. Traces are captured at this width, and every step sends it.
        width = min(-(-config.max_model_len // self.block_size), layout.num_blocks_per_lane)
        if self.options.warmup:
            self.backend.warmup(self.model, self.kv_cache, config, width, progress)
        else:
            log.warning("tt.enable_model_warmup is false: the first requests compile%s",
                        " and capture traces while serving" if self.options.traced("decode")
                        or self.options.traced("prefill") else "")
            progress("compile", 0, 0, "warmup disabled (tt.enable_model_warmup=false)")
        # Persistent page table, one row per device row, in device block ids; a row is cleared
        # when its request is released and when a new request takes it (_release, _add): a model
        # that pads a prefill writes the padding through the row's entries past its blocks.
        # A hybrid model has one per KV group (index 0 the first group's; the model gets each
        # layer its group's, page_tables_per_layer); their rows are cleared together.
        self._page_tables = torch.zeros(groups.num_groups, config.num_lanes * config.max_num_seqs, width,
                                        dtype=torch.int32)
        self._page_table = self._page_tables[0]
        self._group_of_layer = groups.group_of_layer if groups.hybrid else None
        self._limits = Limits(config.num_lanes, config.max_num_seqs, layout.num_blocks_per_lane, self.block_size,
                              config.max_model_len, width, self.vocab_size, groups.windows,
                              self.supports_speculative_decoding)
        self.config = config

    @property
    def max_prefill_batch_size(self) -> int:
        """Rows of one prefill step: a lane's rows, or fewer where the backend says the class
        takes fewer users in one prefill (tt-metal's Qwen3-VL: one)."""
        assert self.config is not None
        users = self.backend.max_prefill_users(self.model_cls, self.supports_images)
        return min(users, self.config.max_num_seqs) if users else self.config.max_num_seqs

    @property
    def prefill_buckets(self) -> list[int]:
        """Prefill lengths with a captured trace (empty: any length runs, eagerly)."""
        return sorted(getattr(self.model, "traced_prefill", ()) or ())

    def _kv_heads_and_dim(self) -> tuple[int, int, int]:
        """(KV heads, head size, tensors cached per layer) of the KV cache, as the plugin sizes
        it through vLLM's `get_num_kv_heads` / `get_head_size`. MLA caches one latent head of
        kv_lora_rank + qk_rope_head_dim per token (vLLM: "when using MLA during decode it becomes
        MQA"; tt-metal's DeepSeek V3 cache is (blocks, 1, block_size, kvpe_dim), mla1d.py
        `create_state`), whatever num_key_value_heads and head_dim the config also states."""
        c = self.hf_config
        if latent_attention(c):
            return 1, int(c["kv_lora_rank"]) + int(c.get("qk_rope_head_dim") or 0), 1
        num_heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // num_heads)
        return int(c.get("num_key_value_heads", num_heads)), head_dim, 2

    @functools.cached_property
    def kv_groups(self) -> KvGroups:
        """The layers' KV groups: hybrid where the class reads a page table per layer and its
        attention mixes sliding-window and full-attention layers (the class says which layer
        slides how far: `kv_layer_windows`, the mask its forward applies; worker/kv_groups.py)."""
        num_layers = int(self.hf_config["num_hidden_layers"])
        if not self.backend.hybrid_kv_cache(self.model_cls):
            return uniform(num_layers)
        return group_layers(self.model_cls.kv_layer_windows(self.hf_config))

    def kv_layout(self, config: ServingConfig) -> KvLayout:
        """The KV cache `config` gets: blocks per lane and what each holds (also `ttserve check`'s,
        before anything loads)."""
        c = self.hf_config
        num_kv_heads, head_dim, tensors = self._kv_heads_and_dim()
        num_layers = int(c["num_hidden_layers"])
        groups = self.kv_groups
        # A block holds one group's layers (layer i of every group shares a buffer).
        bytes_per_block = (groups.group_size * tensors * num_kv_heads * self.block_size * head_dim
                           * torch.empty((), dtype=self.dtype).element_size())
        # Blocks for max_num_seqs max_model_len sequences in every group: more than a hybrid
        # model's sliding groups hold, but a bound.
        wanted = -(-config.max_num_seqs * config.max_model_len // self.block_size) * groups.num_groups
        # On a mesh the model states its budget; the sim's profile fixes one; else bytes decide.
        fixed = (self.backend.kv_tokens_per_lane(self.model_cls, self.model_path, config, self.block_size)
                 or self.options.kv_tokens_per_lane)
        if fixed:  # a null block comes out of the model's budget
            usable = min(wanted, -(-fixed // self.block_size) - self._null_blocks)
            if usable < 1:
                raise ValueError(f"the model's KV budget of {fixed} tokens per lane holds no KV block of "
                                 f"{self.block_size} tokens beside the null block")
            return KvLayout(usable, self.block_size, num_layers, num_kv_heads, head_dim, tensors, groups)
        affordable = self.kv_cache_bytes // (bytes_per_block * config.num_lanes) - self._null_blocks
        if affordable < 1:
            raise ValueError(f"--kv-cache-memory-bytes {self.kv_cache_bytes} cannot hold one KV block "
                             f"({bytes_per_block * config.num_lanes} bytes over {config.num_lanes} lanes)")
        return KvLayout(min(wanted, affordable), self.block_size, num_layers, num_kv_heads, head_dim, tensors, groups)

    # ---- steps ---------------------------------------------------------------------------
    def reset(self) -> None:
        """A new step stream starts with no request state and nothing on the device: a
        pipelined decode the last stream left behind (it ended while one was held) is read
        back and dropped, so the backend's count of decodes in flight starts at zero."""
        for launched in self._deferred[:]:
            try:
                self.finish(launched)
            except Exception:
                log.exception("dropping a decode the previous step stream left in flight")
        self._deferred.clear()
        self.backend.reset()
        self._requests.clear()
        self._previous_tokens = torch.zeros(0, dtype=torch.long)

    def unanswered(self) -> list[int]:
        """Step ids launched and not yet returned: pipelined decodes held on the device."""
        return [launched.result.step_id for launched in self._deferred]

    def close(self) -> None:
        """Release the model (and its traces) before the device closes."""
        self.reset()
        self.model = self.kv_cache = None
        self.backend.close()

    @property
    def async_decode(self) -> bool:
        """Decode steps can be pipelined: the model reads back asynchronously and decode
        samples on the device (host sampling needs the logits first)."""
        return (self.capabilities.get("supports_sample_on_device", False) and self.backend.resident_tokens
                and async_decode_allowed(self.options.tt, self.capabilities)[0])

    def execute(self, batch: StepBatch) -> StepResult:
        return self.finish(self.launch(batch))

    def step(self, batch: StepBatch, received: float | None = None) -> list[StepResult]:
        """Runs one step batch of the stream and returns the results now complete, in step order.

        The pipeline lives here alone: a decode launched pipelined stays on the device (in
        `_deferred`) until the next batch has been launched, then its result is returned ahead of
        that batch's (which itself may stay, if pipelined too)."""
        launched = self.launch(batch, received)
        done = [self.finish(earlier) for earlier in self._deferred[:] if earlier is not launched]
        if not launched.deferred:
            done.append(self.finish(launched))
        return done

    def launch(self, batch: StepBatch, received: float | None = None) -> Launched:
        """Start a step. A pipelined decode (async_readback) returns with its result still on
        the device; `finish` collects it, after the next step has been launched."""
        if self.config is None:
            raise StepError("step received before warmup")
        started = time.perf_counter()
        received = started if received is None else received
        batch, refused = check_batch(batch, self._limits, self._requests)
        for request_id, problem in refused.items():
            log.warning("step %d: refused request %s: %s", batch.step_id, request_id, problem)
            self._release(request_id)
        for request_id in batch.released_ids:
            self._release(request_id)
        for new in batch.new_requests:
            self._add(new)
        launched = Launched(StepResult(step_id=batch.step_id, kind=batch.kind, traced=self.options.traced(batch.kind),
                                       refused=refused), started, received)
        if batch.kind == "prefill" and batch.prefill:
            result = launched.result
            result.tokens, result.logprobs, result.sampled_on_device = self._prefill(batch.prefill)
        elif batch.kind == "decode" and batch.decode:
            self._decode(batch.decode, launched, batch.async_readback and self.async_decode)
        return launched

    def finish(self, launched: Launched) -> StepResult:
        """Wait for a launched step's readback and return its result."""
        result = launched.result
        if launched.pending is not None:
            self._deferred.remove(launched)
            out = self.backend.finish_decode(self.model, launched.pending)
            result.tokens = self._collect(launched.items, out.reshape(-1).tolist())
        now = time.perf_counter()
        result.model_s, result.total_s = now - launched.started, now - launched.received
        return result

    def _release(self, request_id: str) -> None:
        """Drop a request's state and clear its page-table row: ids left past a later request's
        blocks would send a model's padding into blocks another request now owns."""
        state = self._requests.pop(request_id, None)
        if state is not None:
            self._page_tables[:, state.row] = 0

    def _add(self, new: NewRequest) -> None:
        self._page_tables[:, new.row] = 0
        generator = None
        if new.seed is not None:
            # A resumed request (preempted, or migrated here) replays the draws of the tokens it
            # already has, so it goes on as if it had never moved.
            replay = new.num_output_tokens if draws(new.temperature, new.top_k) else 0
            generator = seeded_generator(new.seed, replay)
        # new.host is None unless some host option is set (wire.py drops inactive ones).
        self._requests[new.request_id] = RequestState(
            new.row, new.temperature, new.top_p, new.top_k, generator, new.seed, new.min_tokens,
            new.min_tokens_blocked_ids, new.num_output_tokens, host=new.host,
            group_lengths=[0] * (len(self._page_tables) - 1))

    def _state(self, request_id: str, new_block_ids: list[int], groups: list[GroupBlocks]) -> RequestState:
        state = self._requests.get(request_id)
        if state is None:
            raise StepError(f"request {request_id} has no device state (never added, or released)")
        if new_block_ids:
            first = len(state.block_ids)
            state.block_ids += new_block_ids
            self._page_table[state.row, first:first + len(new_block_ids)] = torch.tensor(
                new_block_ids, dtype=torch.int32) + self._null_blocks
        for g, blocks in enumerate(groups, start=1):
            table = self._page_tables[g, state.row]
            # New blocks follow the entries so far and the skipped ones (a prefix hit's first
            # chunk skips entries the table never had: device.proto GroupBlocks).
            first = max(state.group_lengths[g - 1], blocks.num_skipped_blocks)
            if blocks.new_block_ids:
                table[first:first + len(blocks.new_block_ids)] = torch.tensor(
                    blocks.new_block_ids, dtype=torch.int32) + self._null_blocks
            state.group_lengths[g - 1] = first + len(blocks.new_block_ids)
            # Out of the window: freed, maybe another request's by now. Device block 0 (the null
            # block, where there is one): never written through this row (step_check bounds the
            # skipped entries by the item's window), read only masked.
            table[:blocks.num_skipped_blocks] = 0
        return state

    def _per_layer(self, tables: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """A hybrid model's `page_tables_per_layer` from its groups' tables [groups, rows, width]:
        layer i gets its group's (one tensor per group, shared by its layers), as the TT plugin's
        `_block_tables_per_layer` expands them; {} for a model of one group."""
        if self._group_of_layer is None:
            return {}
        per_group = tables.unbind(0)
        return {"page_tables_per_layer": [per_group[g] for g in self._group_of_layer]}

    def _prefill(self, chunks: list[PrefillChunk]
                 ) -> tuple[dict[str, int], dict[str, TokenLogprobs], bool]:
        states = [self._state(c.request_id, c.new_block_ids, c.groups) for c in chunks]
        # tt-metal's layout: row i holds the sequence from position 0 (the real tokens: a
        # generator may recompute from below start_pos) and the model computes
        # tokens[i, start_pos:prompt_len].
        # The torch backend pads to the longest row of the batch, not to a traced bucket: on a
        # CPU, padding is pure extra arithmetic.
        rows_tokens = [self._prefix_with(state, chunk) for state, chunk in zip(states, chunks)]
        tokens = torch.zeros(len(chunks), max(map(len, rows_tokens)), dtype=torch.long)
        for i, row_tokens in enumerate(rows_tokens):
            tokens[i, :len(row_tokens)] = torch.tensor(row_tokens, dtype=torch.long)
        rows = [s.row for s in states]
        images = self._prefill_images(states, chunks)
        # An intermediate chunk samples nothing: greedy and without its generator, so a seeded
        # request draws the same random numbers however its prompt was chunked.
        sampling = _sampling_batch([s if c.sample else None for s, c in zip(states, chunks)],
                                   [c.token_bitmask if c.sample else None for c in chunks])
        # A vision model's prefill may return logits whatever it is asked (the backend says).
        host_only = self.supports_images and self.backend.vision_prefill_samples_on_host
        on_device = not host_only and self._samples_on_device(
            "prefill", states, all(c.sample for c in chunks), any(c.token_bitmask for c in chunks))
        out = self.backend.prefill(
            self.model, tokens=tokens, page_table=self._page_table[rows], kv_cache=self.kv_cache,
            **self._per_layer(self._page_tables[:, rows]),
            prompt_lens=torch.tensor([c.start_pos + len(c.token_ids) for c in chunks]),
            start_pos=torch.tensor([c.start_pos for c in chunks]),
            sampling_params=self.backend.sampling_params(sampling, [s.seed for s in states]) if on_device else None,
            empty_slots=rows, **images, **({"rope_deltas": True} if self.uses_mrope else {}))
        if self.uses_mrope:
            out, deltas = out
            for state, delta in zip(states, torch.as_tensor(deltas).reshape(-1).tolist()):
                state.rope_delta = int(delta)
        for state, chunk in zip(states, chunks):
            end = chunk.start_pos + len(chunk.token_ids)
            for image in state.images:  # in the KV cache now: the pixels are not needed again
                if image.end <= end and "pixel_values" in image.data:
                    image.data = {k: v for k, v in image.data.items() if k != "pixel_values"}
        logprobs: list[TokenLogprobs | None] = [None] * len(chunks)
        if on_device:
            sampled = out
        else:
            # [B, V], or [B, S, V] with each row's next-token logits last: tt-metal generators
            # return [B, 1, V]; DeepSeek V3's returns every position, each row cut to its prompt and
            # padded by repeating its last real row (the plugin reads tt_out[rows, -1, :]).
            logits = (out[:, -1, :] if out.dim() == 3 else out).reshape(len(chunks), -1)
            sampled = sample(logits, sampling)
            logprobs = gather_logprobs(logits, sampled, sampling)
        tokens = {c.request_id: int(t) for c, t in zip(chunks, sampled.tolist()) if c.sample}
        for request_id, token in tokens.items():
            self._requests[request_id].sampled(token)
        wanted = {c.request_id: lp for c, lp in zip(chunks, logprobs) if lp is not None}
        return tokens, wanted, on_device

    def _prefill_images(self, states: list[RequestState], chunks: list[PrefillChunk]) -> dict[str, list]:
        """A vision model's image inputs of a prefill, as the TT plugin gathers them
        (model_runner.py `_gather_multi_modal_inputs`): per prefill user None (no images) or a
        list over the images in its row [0, chunk end): pixel_values of the ones this chunk
        computes, None for ones before start_pos (in the KV cache already), and every grid."""
        if not self.supports_images:
            return {}
        pixel_values: list[list | None] = []
        grids: list[list | None] = []
        for state, chunk in zip(states, chunks):
            state.images += chunk.images
            end = chunk.start_pos + len(chunk.token_ids)
            mine = [image for image in state.images if image.offset < end]
            if not mine:
                pixel_values.append(None)
                grids.append(None)
                continue
            pixel_values.append([image.data.get("pixel_values") if image.offset >= chunk.start_pos else None
                                 for image in mine])
            grids.append([image.data.get("image_grid_thw") for image in mine])
        return {"pixel_values": pixel_values, "image_grid_thw": grids}

    def _prefix_with(self, state: RequestState, chunk: PrefillChunk) -> list[int]:
        """The request's tokens [0, chunk end): what the worker holds of it, after the cached
        prefix the control plane sends with a request's first chunk."""
        if chunk.cached_token_ids:
            state.prefix = list(chunk.cached_token_ids)
        assert len(state.prefix) == chunk.start_pos, "step_check refuses a chunk past what the worker holds"
        state.prefix += chunk.token_ids
        row = state.prefix
        if chunk.sample:
            state.prefix = []  # the prompt is in; decode feeds one token at a time
        return row

    def _samples_on_device(self, kind: str, states: list[RequestState], no_partial_chunk: bool,
                           masked: bool = False) -> bool:
        """Device sampling is decided per batch: one request that needs the host sampler (or an
        intermediate prefill chunk, or a grammar bitmask, in the batch) sends the whole batch
        there."""
        limit = self._device_top_k
        return (self.capabilities.get("supports_sample_on_device", False)
                and self.options.device_sampling(kind) and no_partial_chunk and not masked
                and not any(s.needs_host_sampler or (limit is not None and s.temperature > 0
                                                     and not 1 <= s.top_k <= limit) for s in states))

    def _decode(self, items: list[DecodeItem], launched: Launched, pipelined: bool) -> None:
        assert self.config is not None
        if any(item.draft_token_ids for item in items):
            self._verify(items, launched.result)
            return
        rows = self.config.num_lanes * self.config.max_num_seqs
        tokens = torch.zeros(rows, 1, dtype=torch.long)
        positions = torch.full((rows,), -1, dtype=torch.long)  # -1: an empty row
        by_row: list[RequestState | None] = [None] * rows
        masks: list[bytes | None] = [None] * rows
        carried: list[int] = []  # rows fed the previous step's token, possibly still on the device
        for item in items:
            state = self._state(item.request_id, item.new_block_ids, item.groups)
            if item.use_previous_token:
                carried.append(state.row)
            else:
                tokens[state.row, 0] = item.token_id
            positions[state.row] = item.position
            by_row[state.row] = state
            masks[state.row] = item.token_bitmask or None
        sampling = _sampling_batch(by_row, masks)
        on_device = self._samples_on_device("decode", [s for s in by_row if s], True, any(masks))
        launched.result.sampled_on_device = on_device
        rope = self._rope_deltas(by_row)
        pending = self.backend.launch_decode(
            self.model, self.backend.sampling_params(sampling, [s.seed if s else None for s in by_row])
            if on_device else None, tokens=tokens, start_pos=positions, page_table=self._page_table,
            kv_cache=self.kv_cache, previous=self._previous_tokens, carried_rows=carried, **rope,
            **self._per_layer(self._page_tables))
        # A readback with nothing to wait for (no events: a CPU computed the step in the launch)
        # is returned now: held, its tokens would wait behind the next step's whole compute, and
        # the control plane could not plan the step after that one until then. The control plane
        # has sent the next step already (it plans ahead for every pipelined decode), so the
        # device still goes from this step to the next without waiting for a round trip.
        if pipelined and on_device and pending.events:
            # The result stays on the device until finish(), after the next step is launched;
            # that step's carried rows take these tokens from it (the backend decides how).
            self._previous_tokens = pending
            launched.pending, launched.items = pending, items
            self._deferred.append(launched)
            return
        out = self.backend.finish_decode(self.model, pending)
        row_logprobs: dict[int, TokenLogprobs] = {}
        if not on_device:
            # Only the live rows are sampled: the others' logits are garbage by contract, and
            # a step of a few requests should not pay for every row the batch could hold.
            live = sorted(s.row for s in by_row if s)
            logits = out.reshape(rows, -1)
            if len(live) < rows:  # (a full batch is read in place: no copy of every row's logits)
                logits = logits[live]
            picked = sampling.select(live)
            sampled = sample(logits, picked)
            out = torch.zeros(rows, dtype=torch.long, device=sampled.device)
            out[live] = sampled
            row_logprobs = {row: lp for row, lp in zip(live, gather_logprobs(logits, sampled, picked))
                            if lp is not None}
        self._previous_tokens = out = out.reshape(-1)
        result = launched.result
        result.tokens = self._collect(items, out.tolist())
        if row_logprobs:
            result.logprobs = {rid: lp for rid in result.tokens
                               if (lp := row_logprobs.get(self._requests[rid].row)) is not None}

    def _rope_deltas(self, by_row: list[RequestState | None]) -> dict[str, list[int]]:
        """An mRoPE model's `rope_deltas_all_users`: every row's rope delta, by row (tt-metal's
        authoritative list; the plugin sends it whenever its batch changed); {} otherwise."""
        return {"rope_deltas_all_users": [s.rope_delta if s else 0 for s in by_row]} if self.uses_mrope else {}

    def _verify(self, items: list[DecodeItem], result: StepResult) -> None:
        """A decode step with draft tokens (speculative decoding, device.proto
        DecodeItem.draft_token_ids): one `verify` forward over the step's rows, row i feeding its
        token and its k_i drafts from its position (rows without drafts: k = 0, plain decode rows
        of the same call), then sampling.verify's acceptance on the host, never on the device and
        never pipelined (the control plane sends no async_readback with drafts; step_check
        refused drafts with a carried token). Every new token, accepted draft then final, goes
        through RequestState.sampled in order, so penalty histories and min_tokens count them;
        a seeded row's generator advances one uniform per new token (sampling.py's rule), so a
        resumed request still replays num_output_tokens draws."""
        assert self.config is not None
        states = [self._state(item.request_id, item.new_block_ids, item.groups) for item in items]
        drafts = [list(item.draft_token_ids) for item in items]
        rows = [s.row for s in states]
        fed = [item.token_id for item in items]
        if any(item.use_previous_token for item in items):
            # Only rows without drafts (step_check): the last decode's token, read back already.
            if isinstance(self._previous_tokens, PendingDecode):
                raise StepError("a verify step carries the token of a decode still on the device: "
                                "a step before one with draft tokens must not be pipelined")
            fed = [int(self._previous_tokens[row]) if item.use_previous_token else token
                   for item, row, token in zip(items, rows, fed)]
        tokens = torch.zeros(len(items), 1 + max(map(len, drafts)), dtype=torch.long)
        for i, token in enumerate(fed):
            tokens[i, :1 + len(drafts[i])] = torch.tensor([token, *drafts[i]], dtype=torch.long)
        all_rows = self.config.num_lanes * self.config.max_num_seqs
        by_row: list[RequestState | None] = [None] * all_rows
        for state in states:
            by_row[state.row] = state
        rope = self._rope_deltas(by_row)
        logits = self.backend.verify(
            self.model, tokens=tokens, start_pos=torch.tensor([item.position for item in items]),
            page_table=self._page_table[rows], kv_cache=self.kv_cache,
            num_tokens=torch.tensor([1 + len(d) for d in drafts]), empty_slots=rows, **rope,
            **self._per_layer(self._page_tables[:, rows]))
        sampling = _sampling_batch(states, [item.token_bitmask or None for item in items])
        accepted, final = verify(logits, drafts, sampling)
        draft_logprobs, logprobs = verify_logprobs(logits, drafts, accepted, final, sampling)
        result.sampled_on_device = result.traced = False
        previous = torch.zeros(all_rows, dtype=torch.long)
        for i, (item, state) in enumerate(zip(items, states)):
            rid, token = item.request_id, int(final[i])
            for new_token in (*drafts[i][:accepted[i]], token):
                state.sampled(new_token)
            result.tokens[rid] = previous[state.row] = token
            if drafts[i]:
                result.num_accepted[rid] = accepted[i]
            if logprobs[i] is not None:
                result.logprobs[rid] = logprobs[i]
                if draft_logprobs[i]:
                    result.draft_logprobs[rid] = draft_logprobs[i]
        # A later decode's carried rows (use_previous_token) take the token after the accepted drafts.
        self._previous_tokens = previous

    def _collect(self, items: list[DecodeItem], sampled: list[int]) -> dict[str, int]:
        tokens = {}
        for item in items:
            state = self._requests.get(item.request_id)
            if state is None:
                continue  # released while its step was in flight
            tokens[item.request_id] = token = int(sampled[state.row])
            state.sampled(token)
        return tokens


def _sampling_batch(states: list[RequestState | None], bitmasks: list[bytes | None] | None = None
                    ) -> SamplingBatch:
    """Per-row sampling parameters; rows without a state (padding, intermediate chunks) are greedy."""
    return SamplingBatch(
        temperature=[s.temperature if s else 0.0 for s in states],
        top_k=[s.top_k if s else 0 for s in states],
        top_p=[s.top_p if s else 1.0 for s in states],
        generators=[s.generator if s else None for s in states],
        blocked_token_ids=[s.blocked_token_ids if s else None for s in states],
        host=[s.host if s else None for s in states],
        bitmasks=bitmasks or [])
