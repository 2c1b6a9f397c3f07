"""The simulated mesh: a model that does no arithmetic but takes a Tenstorrent system's time.

It implements tt-metal's generator contract like any other model, so the real runner, lanes,
traces and async readback all run around it; only the device is replaced by a clock. Step times
come from a cost table of tt-metal's published demo figures (PROFILES): a traced decode
step replays one shape at full per-lane capacity, so it costs the same whatever rows are live;
a prefill costs by padded length, one user after another. Tokens are a deterministic function of
the fed token and its position, so runs are reproducible and batching-invariant.

The device is a single queue: work launched while it is busy starts when it frees up. With
`read_from_device=False` a decode returns at once with a handle whose readback event completes
when the device finishes it, which is what lets async decode overlap host work with device time.
"""
from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SimProfile:
    name: str
    description: str
    decode_step_s: float                          # traced decode step at per-lane capacity
    prefill_points: tuple[tuple[int, float], ...]  # (padded tokens, seconds) for one user
    kv_tokens_per_lane: int
    prefill_buckets: tuple[int, ...] = (128, 1024, 2048, 4096, 8192)
    eager_slowdown: float = 2.0                    # untraced step vs traced (assumption)
    compile_s: float = 0.01                        # per warmup shape, scaled down to keep tests fast

    def prefill_s(self, padded_len: int) -> float:
        """Piecewise-linear in length through the published points (linear beyond the last)."""
        lens = [p[0] for p in self.prefill_points]
        i = min(max(bisect.bisect_left(lens, padded_len), 1), len(lens) - 1)
        (l0, t0), (l1, t1) = self.prefill_points[i - 1], self.prefill_points[i]
        return max(t0 + (t1 - t0) * (padded_len - l0) / (l1 - l0), 0.001)

    def verify_s(self, draft_tokens: int) -> float:
        """A verify step of speculative decoding with `draft_tokens` drafts over its rows: the
        traced decode step (its shape at full capacity, each row's fed token) plus the drafts'
        compute at the marginal prefill cost per token (the slope between the first two published
        prefill points). An assumption, not a published figure: it supposes the verify shape is
        traced like decode, and that a step with more than one token a row stops being bound by
        the weights alone."""
        (l0, t0), (l1, t1) = self.prefill_points[:2]
        return self.decode_step_s + draft_tokens * (t1 - t0) / (l1 - l0)

    def bucket(self, length: int) -> int:
        for b in self.prefill_buckets:
            if length <= b:
                return b
        return -(-length // self.prefill_buckets[-1]) * self.prefill_buckets[-1]


# tt-metal's published demo figures (the LLM performance table of its README and the models'
# demo READMEs; batch 32, 128 input tokens unless noted): a decode step is 1 / (tokens/s/user),
# a prefill point is the TTFT measured at that input length.
PROFILES = {p.name: p for p in (
    SimProfile("galaxy-llama-3.3-70b", "Llama 3.3 70B on a Wormhole Galaxy (TG), 4 lanes x 8",
               decode_step_s=1 / 72.5,
               prefill_points=((128, 0.053), (1024, 0.162), (4096, 0.627), (8192, 1.382), (32768, 9.482)),
               kv_tokens_per_lane=131072),
    SimProfile("t3k-llama-3.3-70b", "Llama 3.3 70B on a T3K / QuietBox",
               decode_step_s=1 / 15.9, prefill_points=((128, 0.159), (1024, 0.6), (8192, 4.8)),
               kv_tokens_per_lane=65536),
    SimProfile("n150-llama-3.1-8b", "Llama 3.1 8B on an n150",
               decode_step_s=1 / 22.3, prefill_points=((128, 0.104), (1024, 0.45)),
               kv_tokens_per_lane=32768, prefill_buckets=(128, 1024)),
    SimProfile("n300-llama-3.1-8b", "Llama 3.1 8B on an n300",
               decode_step_s=1 / 33.5, prefill_points=((128, 0.080), (1024, 0.30), (8192, 2.2)),
               kv_tokens_per_lane=65536),
    SimProfile("t3k-llama-3.1-8b", "Llama 3.1 8B on a T3K",
               decode_step_s=1 / 45.6, prefill_points=((128, 0.064), (1024, 0.22), (8192, 1.6)),
               kv_tokens_per_lane=131072),
)}


class SimDevice:
    """One in-order device queue on the wall clock."""

    def __init__(self) -> None:
        self._free_at = 0.0
        self._lock = threading.Lock()

    def launch(self, seconds: float) -> float:
        """Queue `seconds` of device work; returns when it completes (monotonic time)."""
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + seconds
            return self._free_at


@dataclass
class SimEvent:
    done_at: float

    def synchronize(self) -> None:
        delay = self.done_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)


@dataclass
class SimOutput:
    """A decode result still on the device until its event completes."""
    tokens: torch.Tensor
    event: SimEvent
    # A host-sampled step's logits, made at launch (set iff the step was launched without
    # sampling_params and not read at once); process_decode_output_host returns them.
    logits: torch.Tensor | None = None


def next_token(token: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    return (token * 1103515245 + position * 12345 + 7) % vocab


class SimModel:
    """tt-metal's generator contract over a SimProfile (bind one with `for_profile`)."""

    profile: SimProfile
    model_capabilities = {"supports_prefix_caching": True, "supports_async_decode": True,
                          "supports_sample_on_device": True, "supports_chunked_prefill": True}

    @classmethod
    def for_profile(cls, profile: SimProfile) -> type:
        return type(f"Sim[{profile.name}]", (cls,), {"profile": profile})

    def __init__(self, vocab_size: int, max_batch_size: int, lanes: int) -> None:
        self.vocab_size = vocab_size
        self.max_batch_size = max_batch_size
        self.lanes = lanes
        self.device = SimDevice()
        self.traced_prefill: set[int] = set()
        self.traced_decode = False

    @classmethod
    def initialize_vllm_model(cls, hf_config: dict, mesh_device: Any, max_batch_size: int, max_seq_len: int,
                              tt_data_parallel: int = 1, **_: Any) -> "SimModel":
        return cls(int(hf_config["vocab_size"]), max_batch_size, tt_data_parallel)

    def allocate_kv_cache(self, kv_cache_shape: tuple, dtype: torch.dtype, num_layers: int) -> list:
        return [[] for _ in range(self.lanes)]  # nothing to hold: tokens need no KV here

    # ---- warmup: compile every shape, then capture ----------------------------------------
    def warmup_model_prefill(self, kv_cache: Any = None, enable_trace: bool = False, **_: Any) -> None:
        for length in self.profile.prefill_buckets:
            time.sleep(self.profile.compile_s)
            if enable_trace:
                self.traced_prefill.add(length)

    def warmup_model_decode(self, kv_cache: Any = None, enable_trace: bool = False, **_: Any) -> None:
        time.sleep(self.profile.compile_s)
        self.traced_decode = self.traced_decode or enable_trace

    # ---- steps ------------------------------------------------------------------------------
    def prefill_forward(self, tokens: torch.Tensor, page_table: Any = None, kv_cache: Any = None,
                        prompt_lens: Any = None, start_pos: Any = None, enable_trace: bool = False,
                        sampling_params: Any = None, empty_slots: Any = None, **_: Any) -> torch.Tensor:
        ends = torch.as_tensor(prompt_lens).long()
        starts = torch.zeros_like(ends) if start_pos is None else torch.as_tensor(start_pos).long()
        seconds = 0.0
        for start, end in zip(starts.tolist(), ends.tolist()):
            padded = self.profile.bucket(end - start)
            traced = enable_trace and padded in self.traced_prefill
            seconds += self.profile.prefill_s(padded) * (1 if traced else self.profile.eager_slowdown)
        done = SimEvent(self.device.launch(seconds))
        # The device's output is made while its time runs, not after: the host's cost of emulating
        # the device must not show as host work in a step (sim_http measures the host path).
        last = tokens.gather(1, (ends - 1).clamp(min=0)[:, None])[:, 0]
        out = next_token(last, ends - 1, self.vocab_size)
        out = out if sampling_params is not None else _one_hot_logits(out, self.vocab_size)
        done.synchronize()
        return out

    def decode_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: Any = None,
                       kv_cache: Any = None, enable_trace: bool = False, read_from_device: bool = True,
                       sampling_params: Any = None, **_: Any) -> Any:
        traced = enable_trace and self.traced_decode
        seconds = self.profile.decode_step_s * (1 if traced else self.profile.eager_slowdown)
        done = SimEvent(self.device.launch(seconds))  # the output is made while the device's time runs
        positions = torch.as_tensor(start_pos).long()
        out = torch.where(positions >= 0, next_token(tokens.reshape(-1).long(), positions, self.vocab_size), 0)
        host_sampled = sampling_params is None and not read_from_device
        handle = SimOutput(out, done, _one_hot_logits(out, self.vocab_size) if host_sampled else None)
        return self.read_decode_output(handle) if read_from_device else handle

    def verify_forward(self, tokens: torch.Tensor, start_pos: Any, page_table: Any = None, kv_cache: Any = None,
                       num_tokens: Any = None, **_: Any) -> torch.Tensor:
        """Speculative decoding's verify step (the reference models' contract): logits [B, S, V]
        whose argmax at [i, j] is the token after row i's j-th token, at the profile's verify_s."""
        starts = torch.as_tensor(start_pos).long().reshape(-1)
        counts = torch.as_tensor(num_tokens).long().reshape(-1)
        done = SimEvent(self.device.launch(self.profile.verify_s(int((counts - 1).clamp(min=0).sum()))))
        rows, width = tokens.shape
        positions = starts[:, None] + torch.arange(width)[None, :]
        out = next_token(tokens.long(), positions, self.vocab_size).reshape(-1)
        logits = _one_hot_logits(out, self.vocab_size).reshape(rows, width, self.vocab_size)
        done.synchronize()
        return logits

    def read_decode_output(self, out: SimOutput, async_read: bool = False) -> Any:
        if async_read:
            return out, [out.event]
        out.event.synchronize()
        return out.tokens

    def process_decode_output_host(self, out: Any, is_tokens: bool = False) -> torch.Tensor:
        if isinstance(out, SimOutput):
            if not is_tokens and out.logits is not None:
                return out.logits
            out = out.tokens
        return out.reshape(-1) if is_tokens else _one_hot_logits(out.reshape(-1), self.vocab_size)


def _one_hot_logits(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """Logits whose argmax is `tokens` (the host sampling path of a greedy request)."""
    logits = torch.zeros(tokens.shape[0], vocab)
    logits[torch.arange(tokens.shape[0]), tokens] = 1.0
    return logits
