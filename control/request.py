"""A request as the control plane tracks it: token ids in, token ids out.

Its fields change only through the named transitions below, each the one writer of the fields it
names (tests/test_ownership.py checks it), called by whoever holds the request at the time: its
lane's `Scheduler` while it is on a lane, the engine while it is on none (arriving, migrating).
Two exceptions, written elsewhere by design: the block tables (`block_tables`,
`num_skipped_blocks`, `num_published_blocks`) are written only by its lane's `BlockPool`
(control/blocks.py), and the client-facing progress
(`num_sent_tokens`, `unsent_logprobs`) and lifecycle times by `mark_sent` and the `record_*`
events, here too.

    WAITING --started--> RUNNING --finish--> FINISHED
       ^                    |
       +--preempted/requeued+   (device state dropped: it recomputes from its tokens)
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ttserve.host_sampling import TokenLogprobs, draft_problem, has_penalties, needs_host_sampler

from .images import ImageInput, block_extras
from .prefix_hash import chain_hashes

__all__ = ["FinishReason", "Request", "RequestStatus", "SamplingParams", "TokenLogprobs"]

# Failed steps after which a request that fails a step alone is failed (the first failure
# may have been a batch-mate's; a second, alone, is its own).
POISON_FAILURES = 2

if TYPE_CHECKING:
    from .grammar import Grammar, GrammarSpec
    from .request_trace import RequestTrace


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # not on a device row; KV (if any) freed
    RUNNING = "running"      # holds a row and blocks
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"            # EOS or a stop token id
    LENGTH = "length"        # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """What one request asks of sampling (applied by the worker) and of stopping (applied here)."""
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    # Host-sampler options (vLLM's SamplingParams semantics; the worker applies them).
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    logprobs: int | None = None     # top-k logprobs per sampled token; None = none

    @property
    def has_penalties(self) -> bool:
        return has_penalties(self)

    @property
    def needs_host_sampler(self) -> bool:
        """Options the device sampler cannot express (min_tokens aside: it lapses)."""
        return needs_host_sampler(self)


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    client_id: int = 0
    cache_salt: str = ""
    # The gateway's name for the API key that sent it ("" without keys), and the bytes it holds
    # here until it finishes (its AddRequest's wire size: prompt and images): queue_bounds.py.
    tenant: str = ""
    held_bytes: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Invariant: KV of all_token_ids[:num_computed_tokens] is in its blocks (block_tables; a
    # sliding-window group's: the tokens its window still reads).
    num_computed_tokens: int = 0
    # Sampling rows planned for it whose results have not been applied: 1 while a step that
    # samples it runs, 2 while a pipelined decode (async decode) runs ahead of that one. Its next
    # decode feeds position num_tokens - 1 + num_in_flight (vLLM V1's output placeholders).
    num_in_flight: int = 0
    # The prefill since the last (re)admission has sampled: the request decodes from now on.
    prefilled: bool = False
    # Per KV group, the blocks it holds (written by its lane's BlockPool alone; empty while it
    # holds none), and per group how many leading blocks a sliding window let go (blocks.py).
    block_tables: list[list[int]] = field(default_factory=list)
    num_skipped_blocks: list[int] = field(default_factory=list)
    # Where it runs, chosen at arrival and never changed: worker index and lane within it.
    worker: int = 0
    lane: int = 0
    # Lane-local slot while RUNNING; the device row is lane * max_num_seqs + slot.
    slot: int | None = None
    # Index into output_token_ids up to which outputs have been sent to the client.
    num_sent_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (reported to the client).
    num_cached_tokens: int = 0
    # Chained hashes of the request's full blocks (prefix_hash.py), and how many of its blocks
    # are published to the pool's prefix cache.
    block_hashes: list[int] = field(default_factory=list)
    num_published_blocks: int = 0
    # False while waiting for something other than KV (a grammar compiling): the scheduler
    # sets it aside without blocking the queue behind it.
    ready: bool = True
    # Structured output: the spec asked for, and its compiled state once ready (grammar.py).
    # The grammar has consumed exactly output_token_ids; every sampled token is masked by it.
    grammar_spec: GrammarSpec | None = None
    grammar: Grammar | None = None
    # Images in the prompt, by offset (control/images.py), and how many of them the request's
    # current device state has received (0 again whenever that state is dropped).
    images: list[ImageInput] = field(default_factory=list)
    num_sent_images: int = 0
    num_preemptions: int = 0
    num_migrations: int = 0              # times it moved off a lost worker
    # Steps that failed inside the model while carrying it (StepResult.error), and whether it
    # runs isolated: in steps of its own, so that a request whose inputs make the model raise
    # fails alone instead of taking its batch-mates with it (see step_failed).
    num_failed_steps: int = 0
    isolated: bool = False
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    error: str = ""
    # With FinishReason.ERROR: the request itself cannot be served (its structured output, or
    # inputs that make the model or the worker refuse it), not the serving side's fault.
    invalid: bool = False
    # Logprobs of output_token_ids[num_sent_tokens:] (when the request asked for logprobs).
    unsent_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Lifecycle events (time.monotonic() of this process), recorded where they happen (arrival
    # in the engine, first sent by its worker group, tokens as the engine publishes them) and
    # read by metrics and the request log line.
    received_time: float = 0.0
    scheduled_time: float | None = None      # first sent to a worker
    first_token_time: float | None = None
    last_token_time: float | None = None
    previous_token_time: float | None = None  # the arrival before the last (None: the last was the first)
    num_timed_tokens: int = 0                # output tokens whose arrival is recorded
    # Output tokens it arrived with (resumed): produced elsewhere, so not counted as generated here.
    num_resumed_tokens: int = 0
    # Tracing (control/request_trace.py): the W3C trace context it arrived with (engine.proto
    # AddRequest.trace_headers), and its span while traced here (None: untraced, or ended).
    trace_headers: dict[str, str] = field(default_factory=dict)
    trace: RequestTrace | None = None

    @property
    def block_ids(self) -> list[int]:
        """Its blocks in the first KV group (full attention: one per logical block)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefilling(self) -> bool:
        """The request needs prefill steps before it can decode.

        Prefill computes all known tokens (the prompt, or for a resumed request prompt + outputs)
        and samples the next one, after which exactly the last token lacks KV: decode feeds it.
        """
        return not self.prefilled

    @property
    def needs_host_sampler(self) -> bool:
        """Its steps sample on the host (a grammar masks every token), so they are never
        pipelined (min_tokens aside: it lapses)."""
        return self.sampling.needs_host_sampler or self.grammar_spec is not None

    @property
    def can_speculate(self) -> bool:
        """Its next tokens can be verified from the logits alone (speculative decoding): no
        grammar, no option that reads the token history (penalties, bad words) or reshapes the
        logits beyond temperature, top-k, top-p and min-p (bias, allowed ids), and min_tokens no
        longer masking EOS. Logprobs are returned for every accepted token."""
        return (self.grammar_spec is None and draft_problem(self.sampling) is None
                and self.sampling.min_tokens <= len(self.output_token_ids))

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def ends_in_flight(self, max_model_len: int) -> bool:
        """The steps in flight certainly end it (max_tokens or max_model_len), whatever they
        sample: a step planned now would only fill a row whose result is dropped."""
        return (len(self.output_token_ids) + self.num_in_flight >= self.sampling.max_tokens
                or self.num_tokens + self.num_in_flight >= max_model_len)

    # ---- transitions ---------------------------------------------------------------------------
    def placed(self, worker: int, lane: int) -> None:
        """It joins a lane of a worker (at admission, or moved off another worker)."""
        self.worker, self.lane = worker, lane

    def await_grammar(self) -> None:
        """Its grammar compiles: it waits aside, never scheduled, until grammar_ready."""
        self.ready = False

    def grammar_ready(self, grammar: Grammar) -> None:
        """Its grammar compiled: it may be scheduled (it waited aside until now)."""
        self.grammar, self.ready = grammar, True

    def step_failed(self, alone: bool) -> bool:
        """A step that carried it failed in the model. It runs isolated from now on; True when it
        has failed a step alone after an earlier failure: it is the culprit, not a batch-mate."""
        self.num_failed_steps += 1
        self.isolated = True
        return alone and self.num_failed_steps >= POISON_FAILURES

    def step_succeeded(self) -> None:
        """A decode step of its own succeeded: after one failure it rejoins batches (it was a
        batch-mate of the culprit); after two it stays isolated to its end (a fault at a later
        position would otherwise take its batch again and again)."""
        if self.num_failed_steps < POISON_FAILURES:
            self.isolated = False

    def started(self, slot: int, num_computed_tokens: int) -> None:
        """Admitted to a row of its lane, with its prefix-cache hits (num_computed_tokens) in
        place; the first admission reports them to the client as cached."""
        assert self.status is RequestStatus.WAITING and self.slot is None
        self.status, self.slot, self.num_computed_tokens = RequestStatus.RUNNING, slot, num_computed_tokens
        if self.num_preemptions == 0:
            self.num_cached_tokens = num_computed_tokens

    def planned(self) -> None:
        """A step that samples its next token was planned (its result applies with `sampled`)."""
        self.num_in_flight += 1

    def resumed(self, output_token_ids: list[int]) -> None:
        """It arrives with output another control plane produced and the client already has
        (AddRequest.resumption): that output is its own, already sent and timed, and prefills
        with the prompt at its first admission here."""
        assert not self.output_token_ids and self.status is RequestStatus.WAITING, "resumed only on arrival"
        self.output_token_ids = list(output_token_ids)
        self.num_sent_tokens = self.num_timed_tokens = self.num_resumed_tokens = len(self.output_token_ids)

    def images_sent(self, count: int) -> None:
        """`count` more of its images travel to its device state with the chunk just planned."""
        self.num_sent_images += count

    def computed(self, num_computed_tokens: int) -> None:
        """A step's chunk or decode token landed: KV holds its first `num_computed_tokens` tokens."""
        self.num_computed_tokens = num_computed_tokens

    def sampled(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """A planned step sampled its next token (with logprobs when it asked for them): it
        decodes from now on."""
        assert self.num_in_flight > 0, "a token arrived for a step that was never planned"
        self.num_in_flight -= 1
        self.prefilled = True
        if logprobs is not None:
            self.unsent_logprobs.append(logprobs)
        self.output_token_ids.append(token_id)

    def draft_accepted(self, token_id: int, logprobs: TokenLogprobs | None) -> None:
        """A verify step accepted the draft `token_id` (speculative decoding): it is output like
        a sampled token, before the step's own sampled token (`sampled`)."""
        assert self.num_in_flight > 0, "a draft accepted for a step that was never planned"
        if logprobs is not None:
            self.unsent_logprobs.append(logprobs)
        self.output_token_ids.append(token_id)

    def dropped(self) -> None:
        """Its device state is gone (its lane gave back its row and blocks): images are sent
        again to whatever state it gets next, and no step in flight applies to it any more."""
        self.slot = None
        self.num_sent_images = 0
        self.num_in_flight = 0

    def requeued(self) -> None:
        """Back to waiting with nothing on any device (after `dropped`): it recomputes from its
        prompt and the tokens it has, and the client sees none twice."""
        assert self.slot is None and not self.block_tables
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.prefilled = False

    def preempted(self) -> None:
        """Requeued because its lane's KV cache ran out (counted: metrics and the request log)."""
        self.requeued()
        self.num_preemptions += 1
        if self.trace is not None:
            self.trace.preempted(time.monotonic())

    def traced(self, trace: RequestTrace) -> None:
        """Its span here started (request_trace.RequestTracing.arrived)."""
        self.trace = trace

    def untraced(self) -> None:
        """Its span here ended (refused, or finished)."""
        self.trace = None

    def migrated(self) -> None:
        """It moves off a lost worker (counted against --migration-limit)."""
        self.num_migrations += 1

    def finish(self, reason: FinishReason, error: str = "", invalid: bool = False,
               stop_token_id: int | None = None) -> None:
        """Mark it finished; whoever held its slot and blocks has given them back. `invalid`:
        the error is the request's own (Request.invalid); `stop_token_id`: the stop token (not
        EOS) it ended on."""
        self.status, self.finish_reason, self.error, self.invalid = RequestStatus.FINISHED, reason, error, invalid
        self.stop_token_id = stop_token_id

    def full_block_hashes(self, block_size: int, num_tokens: int) -> list[int]:
        """Chained hashes (prefix_hash.py) of the full blocks within its first `num_tokens`
        tokens; blocks hashed before are not hashed again (the chain is kept here)."""
        full = num_tokens // block_size
        known = self.block_hashes
        if len(known) < full:
            known += chain_hashes(known[-1] if known else None, self.cache_salt,
                                  (self._tokens(i * block_size, (i + 1) * block_size)
                                   + block_extras(self.images, i, block_size) for i in range(len(known), full)))
        return known

    def _tokens(self, start: int, end: int) -> tuple[int, ...]:
        """all_token_ids[start:end] without copying the whole sequence (this runs for every block
        that fills, in the step loop)."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return tuple(prompt[start:end])
        outputs = self.output_token_ids
        if start >= len(prompt):
            return tuple(outputs[start - len(prompt):end - len(prompt)])
        return tuple(prompt[start:]) + tuple(outputs[:end - len(prompt)])

    def samples_on_host(self) -> bool:
        """The next token planned for it is sampled on the host, so its batch cannot be
        pipelined: its options or grammar need the host sampler, or min_tokens still masks its
        EOS (counting the tokens in flight). The one statement of this rule."""
        return self._on_host(len(self.output_token_ids) + self.num_in_flight)

    def planned_on_host(self) -> bool:
        """The token of its latest planned step is sampled on the host (samples_on_host, asked
        once that step is planned)."""
        return self._on_host(len(self.output_token_ids) + self.num_in_flight - 1)

    def _on_host(self, output_index: int) -> bool:
        return self.needs_host_sampler or self.sampling.min_tokens > output_index

    # ---- events ----------------------------------------------------------------------------
    def record_received(self, now: float) -> None:
        self.received_time = now

    def record_scheduled(self, now: float) -> None:
        if self.scheduled_time is None:
            self.scheduled_time = now

    def record_tokens(self, now: float) -> int:
        """Records the arrival of the output tokens not recorded yet (published together at
        `now`); returns how many. Runs for every request with news every step: no allocation."""
        new = len(self.output_token_ids) - self.num_timed_tokens
        if new > 0:
            self.previous_token_time = self.last_token_time
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
            self.num_timed_tokens += new
        return new

    def mark_sent(self) -> None:
        """Its output so far has been sent to the client (session.output_of took the delta:
        its logprobs list goes with it, and a new one starts here)."""
        self.num_sent_tokens = len(self.output_token_ids)
        self.unsent_logprobs = []
