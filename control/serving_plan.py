"""The serving plan: the one place the rules live that turn the control plane's flags and what a
worker says of itself into what it serves with — lanes, max_model_len, the batched-token budget,
the chunk limit, prefix caching, async decode — and that refuse a worker this configuration
cannot serve. Pure functions: nothing here logs, connects or keeps state.

Two moments, one function each:
- `plan_warmup`, before warmup, from the worker's cold description (no KV capacity yet): what
  the worker is asked to warm up for. `ttserve check` runs it on a description made from the
  worker's preflight plan.
- `plan_serving`, once the worker is warm (its KV capacity known): the final plan. The first
  worker's plan fixes the limits every later worker must match (`fixed`).

What each rule decided that an operator should read comes back as `notes`, for the caller to log.
The worker's own share (its KV budget, the page-table width of a max_model_len sequence, whether
its model and options allow async decode) is decided on the worker (worker/runner.py) and
reaches these functions through its description.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ttserve.batched_tokens import default_batched_tokens

from .engine_config import EngineConfig
from .scheduler import SchedulerConfig
from .speculation import SpeculativeConfig
from .wire import WorkerDescription


class IncompatibleWorker(RuntimeError):
    """A worker this configuration cannot serve (topology, model, limits): it is refused alone
    while others serve; the control plane exits with this message when it is the only one."""


@dataclass(frozen=True, slots=True)
class Note:
    """One line for the log: what a rule changed or turned off, and why."""
    level: int    # logging.INFO or logging.WARNING
    text: str


@dataclass(frozen=True, slots=True)
class WarmupPlan:
    """What a worker is asked to warm up for (device.proto WarmupRequest)."""
    num_lanes: int
    max_num_seqs: int               # per lane
    max_model_len: int              # before the worker's KV capacity is known
    max_num_batched_tokens: int     # raised to max_model_len for a model that cannot chunk prefills
    notes: tuple[Note, ...] = ()


@dataclass(frozen=True, slots=True)
class ServingPlan:
    """What one warm worker serves with. The first worker's plan is the control plane's serving
    limits (`Engine.serving`): model, vocabulary, block size and max_model_len, which every later
    worker must match."""
    architecture: str
    vocab_size: int
    block_size: int                 # one for all: prefix hashes, placement and ModelInfo assume it
    supports_images: bool
    num_lanes: int
    scheduler: SchedulerConfig      # each lane's: rows, max_model_len, budget, chunking, prefill shape
    chunk_limit: int                # longest prefill chunk with chunked prefill; 0: whole prompts
    prefix_caching: bool
    async_decode: bool              # pipeline decode steps (two in flight)
    notes: tuple[Note, ...] = ()
    kv_windows: tuple[int, ...] = (0,)  # per KV group: sliding window, 0 = full (blocks.py)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return self.scheduler.speculative

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        return self.scheduler.max_num_batched_tokens


def plan_warmup(config: EngineConfig, d: WorkerDescription, num_workers: int) -> WarmupPlan:
    """What worker `d` (as it describes itself before warmup) is asked to warm up for, with
    `num_workers` in the set. Raises IncompatibleWorker, before the worker touches its device,
    for a topology it cannot run or a --max-model-len beyond the model's own limit."""
    num_lanes = _lanes(config.data_parallel_size, d, num_workers)
    # 0 and -1 ask for the model's own limit here; -1 then fits it to a lane's KV (plan_serving).
    max_model_len = max(config.max_model_len, 0) or d.max_position_embeddings
    if max_model_len > d.max_position_embeddings:
        raise IncompatibleWorker(
            f"--max-model-len {max_model_len} exceeds the model's limit of "
            f"{d.max_position_embeddings} tokens (max_position_embeddings of {d.model_path})")
    notes = []
    batched = config.max_num_batched_tokens or default_batched_tokens(d.backend, d.device)
    if not d.supports_chunked_prefill and batched < max_model_len:
        # Whole prompts only: a smaller budget would leave long prompts waiting forever.
        notes.append(Note(logging.WARNING, "the model cannot chunk prefills: raising max_num_batched_tokens "
                                           f"from {batched} to max_model_len {max_model_len}"))
        batched = max_model_len
    return WarmupPlan(num_lanes, config.max_num_seqs, max_model_len, batched, tuple(notes))


def plan_serving(config: EngineConfig, warm: WorkerDescription, asked: WarmupPlan,
                 fixed: ServingPlan | None) -> ServingPlan:
    """The plan worker `warm` serves with, once warm for `asked`. `fixed`: the plan of the first
    worker, whose limits this one must match (None: this is the first, and fixes them). Raises
    IncompatibleWorker for a later worker of another model or block size, or one whose lane
    cannot hold a max_model_len sequence."""
    notes = []
    if not warm.kv_windows or warm.kv_windows[0] != 0:
        raise IncompatibleWorker(f"the worker at {warm.address} describes KV groups with windows "
                                 f"{list(warm.kv_windows)}: the first group must be full attention (window 0)")
    batched = asked.max_num_batched_tokens
    if warm.supports_chunked_prefill and batched < warm.block_size:
        notes.append(Note(logging.WARNING, f"max_num_batched_tokens raised from {batched} to the block size "
                                           f"{warm.block_size}: a prefill chunk holds at least one block"))
        batched = warm.block_size
    max_prefill_len = max(warm.prefill_buckets, default=0)
    chunk_limit = 0
    if warm.supports_chunked_prefill:
        chunk_limit = min(batched, max_prefill_len) if max_prefill_len else batched
    capacity = lane_capacity(warm, chunk_limit or asked.max_model_len)
    if fixed is None:
        max_model_len = asked.max_model_len
        if capacity < max_model_len:
            # So that any admitted request can run to its end once alone on its lane. -1 asks
            # for exactly this (vLLM's meaning: fit one request to a lane's whole KV cache).
            fitting = config.max_model_len == -1  # asked for: no warning
            notes.append(Note(logging.INFO if fitting else logging.WARNING,
                              f"max_model_len lowered from {max_model_len} to {capacity}: one lane's KV "
                              f"cache holds {capacity} tokens"))
            max_model_len = capacity
    else:
        _check_compatible(warm, capacity, fixed)
        max_model_len = fixed.max_model_len
    async_decode = warm.async_decode and config.async_scheduling is not False
    if config.async_scheduling and not warm.async_decode:
        notes.append(Note(logging.WARNING, f"--async-scheduling: the worker at {warm.address} cannot pipeline "
                                           f"decode steps ({warm.architecture} does not support async decode, "
                                           "or decode samples on the host); turned off"))
    speculative = config.speculative
    if speculative is not None and not warm.supports_speculative_decoding:
        notes.append(Note(logging.WARNING, f"--speculative-config: {warm.architecture} on the worker at {warm.address} "
                                           "cannot verify draft tokens (its class has no verify_forward); serving "
                                           "without speculative decoding"))
        speculative = None
    if speculative is not None and async_decode:
        notes.append(Note(logging.INFO, "speculative decoding: decode steps are not pipelined (a verify step's "
                                        "accepted tokens decide what the next one feeds)"))
        async_decode = False
    caching = config.enable_prefix_caching
    if caching and not warm.supports_prefix_caching:
        notes.append(Note(logging.WARNING, f"--enable-prefix-caching: {warm.architecture} on the worker at "
                                           f"{warm.address} does not support prefix caching; serving without it"))
        caching = False
    scheduler = SchedulerConfig(
        max_num_seqs=asked.max_num_seqs, max_num_batched_tokens=batched, max_model_len=max_model_len,
        chunked_prefill=warm.supports_chunked_prefill, max_prefill_batch=warm.max_prefill_batch_size,
        max_prefill_len=max_prefill_len, speculative=speculative)
    return ServingPlan(warm.architecture, warm.vocab_size, warm.block_size, warm.supports_images, asked.num_lanes,
                       scheduler, chunk_limit, caching, async_decode, tuple(notes), warm.kv_windows)


def lane_capacity(d: WorkerDescription, chunk: int) -> int:
    """The longest sequence one lane's blocks hold, alone, prefilled in chunks of at most `chunk`
    tokens (sequence_blocks), every KV group drawing on the one pool."""
    low, high = 0, d.num_blocks_per_lane  # a sequence of n blocks takes >= n: never more
    while low < high:
        mid = (low + high + 1) // 2
        fits = sum(sequence_blocks(d.kv_windows, d.block_size, mid * d.block_size, chunk)) <= d.num_blocks_per_lane
        low, high = (mid, high) if fits else (low, mid - 1)
    return low * d.block_size


def sequence_blocks(windows: tuple[int, ...], block_size: int, num_tokens: int, chunk: int) -> list[int]:
    """Per KV group, the most blocks one sequence of `num_tokens` holds at once, prefilled in
    chunks of at most `chunk` tokens (control/blocks.py): a full-attention group a block per
    block_size tokens; a sliding group with window W what its last chunk reads, W - 1 tokens
    back and the chunk, over at most one more block than they fill. One block more than a
    block-aligned chunk needs, which a pipelined decode can use: its blocks are given back from
    the tokens computed, two positions behind the one planned."""
    blocks = -(-num_tokens // block_size)
    return [min(blocks, -(-(w - 1 + chunk) // block_size) + 1) if w else blocks for w in windows]


def _lanes(dp: int, d: WorkerDescription, num_workers: int) -> int:
    """The topology rules: lanes this worker runs for --data-parallel-size `dp`."""
    if d.single_execute_lanes:
        # mRoPE models run in lanes too (the TT plugin cannot): a request's rope delta is kept
        # by its row, which is stable while it runs, whatever lane the row is in.
        return dp
    if dp != 1:
        raise IncompatibleWorker(
            f"--data-parallel-size {dp}: {d.architecture} on the worker at {d.address} runs lanes "
            "as independent groups; start one worker per lane (each on its own submesh with "
            "TT_VISIBLE_DEVICES) and pass each with --worker")
    if d.mixture_of_experts and num_workers > 1:
        raise IncompatibleWorker(f"{d.architecture} is a mixture-of-experts model: data parallelism "
                                 f"over independent groups ({num_workers} workers) is refused")
    return 1


def _check_compatible(d: WorkerDescription, capacity: int, s: ServingPlan) -> None:
    """A later worker serves the first one's model with its block size, and one lane holds a
    max_model_len sequence."""
    if (d.architecture, d.vocab_size) != (s.architecture, s.vocab_size):
        raise IncompatibleWorker(f"the worker at {d.address} serves {d.architecture} (vocabulary "
                                 f"{d.vocab_size}) but this control plane serves {s.architecture} "
                                 f"(vocabulary {s.vocab_size}): every worker must serve the same model")
    if d.kv_windows != s.kv_windows:
        raise IncompatibleWorker(f"the worker at {d.address} has KV groups with windows {list(d.kv_windows)} but "
                                 f"the first worker has {list(s.kv_windows)}: every worker must run the same "
                                 "model class and ttserve version")
    if d.block_size != s.block_size:
        raise IncompatibleWorker(f"the worker at {d.address} uses KV blocks of {d.block_size} tokens but "
                                 f"the first worker uses {s.block_size}: start every worker with the same "
                                 "--block-size (prefix caching and placement hash whole blocks)")
    if capacity < s.max_model_len:
        raise IncompatibleWorker(f"the worker at {d.address} holds {capacity} tokens per lane, "
                                 f"below max_model_len {s.max_model_len}: give it more KV memory")
