"""Sampling: turns a step's logits into one token id per row, on the device or on the host.

The device path (inside the model call) expresses temperature, top-k, top-p and a per-request
seed. The host path runs the same `sample` with each row's `HostSampling` too: allowed token
ids, bad words, min_tokens, logit_bias and penalties on the logits, then min_p after the
temperature, in vLLM's order (vllm/v1/sample/sampler.py), and `gather_logprobs` for the rows
that asked. The runner decides per batch which path a batch takes (docs/architecture.md, "The worker").

Reproducibility rule: a request with a seed owns a `torch.Generator` that persists across its
steps, and every token it samples draws exactly one uniform from it, whatever the other rows of
the batch are. So a seeded request yields the same tokens alone or in any batch,
and one that resumes elsewhere (preempted, or migrated off a lost worker) replays its draws
(`seeded_generator`) and goes on with the tokens an uninterrupted run gives.

Speculative decoding (`verify`): a verify step's row judges its draft tokens against the model's
logits at each draft's position and returns the accepted drafts and one token after them, with
plain sampling's output distribution (greedy: its exact tokens). It keeps the rule above: each of
the row's new tokens, accepted draft or final, costs its generator exactly one uniform, so a
resumed request's replay stays right. A uniform decides a token differently in a verify step
(u < p(draft)) than in a plain one (the inverse CDF), so a seeded sampled request gives the same
tokens for the same drafts, and other tokens of the same distribution for other drafts.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Concatenate, ParamSpec, TypeVar

import torch

from .batch import HostSampling, TokenLogprobs

# Logits of at most this many entries (one row of a 128K vocabulary) are sampled on one thread.
# Their ops are too small to gain from a team, and a team that slept while a device computed
# must first be woken: on 2 vCPUs, one row of SmolLM2's 49,152 logits after 50 ms idle took
# 4.1 ms on 2 threads and 1.2 ms on 1 (0.2-0.3 ms either way with the team awake). At 4 rows an
# awake team was faster (1.8 vs 2.1 ms); 2 and 3 rows measured within noise of either.
ONE_THREAD_ENTRIES = 1 << 17

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _one_thread_when_small(fn: Callable[Concatenate[torch.Tensor, _P], _R]
                           ) -> Callable[Concatenate[torch.Tensor, _P], _R]:
    """Runs `fn(logits, ...)` on one torch thread when the logits are on the CPU and small
    (ONE_THREAD_ENTRIES); the calling thread's count is restored after, also on a raise.

    torch keeps the count per thread, and a thread takes the process's default at its first
    parallel op: a thread whose first op fell inside another's window would keep 1 for good. The
    worker runs every torch op of its steps on its one device thread, so none does."""
    @functools.wraps(fn)
    def wrapper(logits: torch.Tensor, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        threads = torch.get_num_threads()
        if threads == 1 or logits.device.type != "cpu" or logits.numel() > ONE_THREAD_ENTRIES:
            return fn(logits, *args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(logits, *args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapper


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters; row i of the batch is row i of the logits.

    temperature: 0 (or less) means greedy. top_k: 0 or less means off. top_p: 1 means off.
    generators: the request's own generator when it asked for a seed, else None (the global
    RNG of the logits' device is used).
    """

    temperature: Sequence[float] | torch.Tensor
    top_k: Sequence[int] | torch.Tensor
    top_p: Sequence[float] | torch.Tensor
    generators: list[torch.Generator | None] = field(default_factory=list)
    # Per row, token ids that must not be sampled this step (EOS and stop ids before
    # min_tokens), or None.
    blocked_token_ids: list[list[int] | None] = field(default_factory=list)
    # Per row, the options only the host sampler applies, or None.
    host: list[HostSampling | None] = field(default_factory=list)
    # Per row, a grammar's allowed tokens (llguidance's bitmask: bit i of little-endian int32
    # words allows token i; ids past its end are disallowed), or None.
    bitmasks: list[bytes | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.temperature)
        if not self.generators:
            self.generators = [None] * n
        if not self.blocked_token_ids:
            self.blocked_token_ids = [None] * n
        if not self.host:
            self.host = [None] * n
        if not self.bitmasks:
            self.bitmasks = [None] * n
        if not (len(self.top_k) == len(self.top_p) == len(self.generators) == len(self.host)
                == len(self.bitmasks) == n):
            raise ValueError(
                f"SamplingBatch fields differ in length: temperature={n} top_k={len(self.top_k)} "
                f"top_p={len(self.top_p)} generators={len(self.generators)} host={len(self.host)}")

    def __len__(self) -> int:
        return len(self.temperature)

    def select(self, rows: list[int]) -> SamplingBatch:
        """The batch of the given rows, in that order."""
        pick = lambda values: [values[r] for r in rows]  # noqa: E731
        return SamplingBatch([float(t) for t in pick(self.temperature)], [int(k) for k in pick(self.top_k)],
                             [float(p) for p in pick(self.top_p)], pick(self.generators),
                             pick(self.blocked_token_ids), pick(self.host), pick(self.bitmasks))

    @classmethod
    def greedy(cls, rows: int) -> SamplingBatch:
        return cls([0.0] * rows, [0] * rows, [1.0] * rows)


def _as_tensor(values: Sequence[float] | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().to("cpu", dtype)
    return torch.tensor(list(values), dtype=dtype)


def draws(temperature: float, top_k: int) -> bool:
    """Whether a row with these values draws from its generator when it samples (else greedy)."""
    return temperature > 0 and top_k != 1


def _uniform(generator: torch.Generator | None, rows: int = 1) -> torch.Tensor:
    """[rows] float64 uniforms in [0, 1), on the host: one per sampled token."""
    return torch.rand(rows, dtype=torch.float64, generator=generator)


def seeded_generator(seed: int, replay: int = 0) -> torch.Generator:
    """A request's generator, on the host (where the draw is made, whatever the model's device:
    the same tokens anywhere), past the draws of the `replay` tokens it sampled before it
    resumed here (one uniform each)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    if replay:
        _uniform(generator, replay)
    return generator


@_one_thread_when_small
def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Samples one token per row of `logits` [B, V]; returns [B] int64 on the logits' device.

    Rows past len(batch) are padding: they are not sampled and return 0.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    n = len(batch)
    if n > rows:
        raise ValueError(f"SamplingBatch has {n} rows but logits only {rows}")
    out = torch.zeros(rows, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    logits = _processed_logits(logits, batch)

    temperature = _as_tensor(batch.temperature, torch.float32)
    top_k = _as_tensor(batch.top_k, torch.int64)
    # top_k == 1 keeps only the argmax, whatever the temperature: greedy without drawing (`draws`).
    greedy = (temperature <= 0) | (top_k == 1)
    if bool(greedy.all()):
        out[:n] = logits[:n].argmax(dim=-1)
        return out

    greedy_rows = greedy.nonzero().flatten()
    if greedy_rows.numel():
        idx = greedy_rows.to(logits.device)
        out[idx] = logits[idx].argmax(dim=-1)

    sampled_rows = (~greedy).nonzero().flatten()
    idx = sampled_rows.to(logits.device)
    min_p = torch.tensor([h.min_p if h else 0.0 for h in batch.host], dtype=torch.float32)
    probs = _filtered_probs(
        (logits if len(sampled_rows) == rows else logits[idx]).float(),
        temperature[sampled_rows].to(logits.device),
        top_k[sampled_rows].to(logits.device),
        _as_tensor(batch.top_p, torch.float32)[sampled_rows].to(logits.device),
        min_p[sampled_rows].to(logits.device),
    )
    u = _uniform(None, len(sampled_rows))
    for j, row in enumerate(sampled_rows.tolist()):
        gen = batch.generators[row]
        if gen is not None:
            u[j] = _uniform(gen)[0]
    out[idx] = _inverse_cdf_rows(probs, u.to(probs.device))
    return out


# Entries per block of the two-level inverse CDF: a divisor of common vocabularies (32,000,
# 49,152, 128,256: 256; 151,936: 128).
CDF_BLOCK = 256


def _inverse_cdf_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of probs [n, V] (not necessarily normalised), the token where the cumulative
    probability first exceeds u * total, u [n] float64 uniforms in [0, 1): the row's
    distribution (to the rounding below), one uniform per row (not one exponential per
    vocabulary entry, as the exponential race draws: 25 of 35 ms at 32 rows x 49,152 tokens on a
    2-core Xeon), and a zero-probability token never owns an interval.

    Two levels, so that no [n, V] float64 tensor is made (a float64 cumulative sum over the whole
    vocabulary, cast on the fly into a fresh 12 MB, took 8-10 ms at 32 x 49,152 in the sampler on a
    2-core EPYC, 2.3 ms alone in a loop; this takes 0.3-0.5): float32 sums of blocks of CDF_BLOCK
    entries, their float64 cumulative sum to find the block, then the float64 cumulative sum
    inside that block alone. A block sum's float32 rounding (~1e-7 of the block's mass) can move a
    boundary by that much; the draw stays inside the chosen block (its last token of non-zero
    probability if the rounding pushed the target past the block's own sum)."""
    n, vocab = probs.shape
    block = CDF_BLOCK
    while vocab % block and block > 16:
        block //= 2
    if vocab % block:  # an odd vocabulary: zero padding owns no interval
        probs = torch.nn.functional.pad(probs, (0, block - vocab % block))
    blocks = probs.shape[1] // block
    cdf = probs.reshape(n, blocks, block).sum(-1).double().cumsum_(-1)
    target = u.unsqueeze(-1) * cdf[:, -1:]
    # Never past the last block holding mass (a target rounding up to the total would land there).
    last_block = (cdf < cdf[:, -1:]).sum(-1, keepdim=True)
    chosen = torch.minimum(torch.searchsorted(cdf, target, right=True), last_block)
    base = torch.where(chosen > 0, cdf.gather(1, (chosen - 1).clamp(min=0)), 0.0)
    local = probs.gather(1, chosen * block + torch.arange(block, device=probs.device)).cumsum(-1, dtype=torch.float64)
    within = torch.searchsorted(local, target - base, right=True)
    last_nonzero = (local < local[:, -1:]).sum(-1, keepdim=True)
    return (chosen * block + torch.minimum(within, last_nonzero)).squeeze(-1).clamp_(max=vocab - 1)


@_one_thread_when_small
def verify(logits: torch.Tensor, drafts: Sequence[Sequence[int]], batch: SamplingBatch
           ) -> tuple[list[int], torch.Tensor]:
    """Speculative decoding's acceptance: row i fed its token and drafts[i] (k_i tokens), and
    logits[i, j] [R, S, V] (S > every k_i) is the model's distribution after its j-th fed token,
    the one draft j is judged against. Returns (a_i, the number of drafts accepted, per row) and
    [R] int64 token ids on the host: the token sampled after the accepted ones (a correction
    after a rejected draft, or the bonus after all k_i). Row i's new tokens are
    drafts[i][:a_i] + [token].

    * A row without drafts is a plain decode row: `sample` of logits[i, 0] with every rule its
      batch row holds (penalties, bitmask, min_tokens, ...).
    * Greedy (`draws` false): draft j is accepted while it is the argmax at j; the token is the
      argmax after the accepted run: plain greedy decoding's tokens, one argmax over the rows.
    * Sampled: rejection sampling against a point-mass proposal. With p_j the row's distribution
      at j as `sample` computes it (temperature, top-k, top-p, min-p: `_filtered_probs`), draft x
      is accepted with probability p_j(x), by one uniform u < p_j(x). On the first rejection the
      token comes from p_j without x, renormalised, and the row stops; after k accepted drafts it
      comes from p_k. Every token so has plain sampling's distribution given the ones before.
      A rejection's uniform, u in [p_j(x), 1), also picks the correction: (u - p_j(x)) / (1 -
      p_j(x)) is uniform in [0, 1) given the rejection, so the row draws one uniform per new
      token (the module's reproducibility rule) and a seeded row is reproducible for the same
      drafts.

    A row with drafts must hold no rule beyond temperature, top-k, top-p and min-p (no bitmask,
    blocked ids or `HostSampling.draft_problem`): step_check refuses those before they run.
    """
    if logits.dim() != 3:
        raise ValueError(f"verify logits must be [rows, positions, vocab], got {tuple(logits.shape)}")
    rows, width, vocab = logits.shape
    counts = [len(d) for d in drafts]
    if len(counts) != rows or len(batch) != rows:
        raise ValueError(f"verify has {rows} logits rows, {len(counts)} draft lists and {len(batch)} sampling rows")
    if any(k >= width for k in counts):
        raise ValueError(f"a row has {max(counts)} drafts; the logits hold {width} positions per row")
    for i, k in enumerate(counts):
        host = batch.host[i]
        problem = ((host.draft_problem if host is not None else None)
                   or ("a grammar bitmask" if batch.bitmasks[i] else None)
                   or ("min_tokens' blocked ids" if batch.blocked_token_ids[i] else None))
        if k and problem:
            raise ValueError(f"row {i} has drafts and {problem}: its drafts cannot be verified")
    accepted = [0] * rows
    out = torch.zeros(rows, dtype=torch.int64)
    plain = [i for i in range(rows) if not counts[i]]
    if plain:
        index = torch.tensor(plain, device=logits.device)
        out[plain] = sample(logits[index, 0], batch.select(plain)).cpu()
    draw = [draws(float(batch.temperature[i]), int(batch.top_k[i])) for i in range(rows)]
    greedy = [i for i in range(rows) if counts[i] and not draw[i]]
    if greedy:
        best = logits[torch.tensor(greedy, device=logits.device)].argmax(dim=-1).cpu()  # [g, S]
        proposed = torch.full((len(greedy), width - 1), -1, dtype=torch.int64)  # -1: never the argmax
        for g, i in enumerate(greedy):
            proposed[g, :counts[i]] = torch.tensor(list(drafts[i]), dtype=torch.int64)
        # Drafts accepted: the length of the run of matches from the first.
        run = (best[:, :-1] == proposed).long().cumprod(dim=-1).sum(dim=-1)
        out[greedy] = best.gather(1, run[:, None]).squeeze(1)
        for g, i in enumerate(greedy):
            accepted[i] = int(run[g])
    sampled = [i for i in range(rows) if counts[i] and draw[i]]
    if sampled:
        # Every real position of the sampled rows, one probability row each, in one pass.
        at = [(i, j) for i in sampled for j in range(counts[i] + 1)]
        pick = lambda values: [values[i] for i, _ in at]  # noqa: E731
        dev = logits.device
        min_p = [h.min_p if h is not None else 0.0 for h in batch.host]
        probs = _filtered_probs(
            logits[torch.tensor([i for i, _ in at], device=dev), torch.tensor([j for _, j in at], device=dev)].float(),
            torch.tensor(pick([float(t) for t in batch.temperature]), device=dev),
            torch.tensor(pick([int(k) for k in batch.top_k]), device=dev),
            torch.tensor(pick([float(p) for p in batch.top_p]), device=dev),
            torch.tensor(pick(min_p), dtype=torch.float32, device=dev)).cpu()
        first = 0
        for i in sampled:
            accepted[i], out[i] = _rejection_sample(probs[first:first + counts[i] + 1], drafts[i], batch.generators[i])
            first += counts[i] + 1
    return accepted, out


def _rejection_sample(probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator | None
                      ) -> tuple[int, int]:
    """One sampled row of `verify`: probs [k + 1, V] its distributions at the k drafts' positions
    and after them. Returns (drafts accepted, the token after them); draws one uniform per token."""
    for j, x in enumerate(drafts):
        u = float(_uniform(generator)[0])
        p_x = float(probs[j, x])
        if u < p_x:
            continue
        residual = probs[j].clone()
        residual[x] = 0.0
        # u is uniform in [p_x, 1) given the rejection (p_x < 1): rescaled, the correction's draw.
        return j, _inverse_cdf(residual, (u - p_x) / (1.0 - p_x), fallback=x)
    return len(drafts), _inverse_cdf(probs[len(drafts)], float(_uniform(generator)[0]))


def _inverse_cdf(probs: torch.Tensor, u: float, fallback: int | None = None) -> int:
    """The token of [V] probabilities (not necessarily normalised) that uniform u in [0, 1) picks,
    as `sample` picks it (_inverse_cdf_rows). `fallback` when nothing is left (a residual whose
    rounding took all the mass: the draft was certain)."""
    if fallback is not None and float(probs.sum()) <= 0.0:
        return fallback
    return int(_inverse_cdf_rows(probs[None], torch.tensor([u], dtype=torch.float64, device=probs.device))[0])


def verify_logprobs(logits: torch.Tensor, drafts: Sequence[Sequence[int]], accepted: Sequence[int],
                    tokens: torch.Tensor, batch: SamplingBatch
                    ) -> tuple[list[list[TokenLogprobs]], list[TokenLogprobs | None]]:
    """A verify step's logprobs (`verify`'s logits, drafts and results), for the rows that asked:
    per row, one entry per accepted draft (logits[i, j] with drafts[i][j] as the sampled token),
    and the final token's (logits[i, a_i]); each as `gather_logprobs` makes it (raw logprobs:
    the sampled token first, then the top-k)."""
    rows = len(drafts)
    per_draft: list[list[TokenLogprobs]] = [[] for _ in range(rows)]
    final: list[TokenLogprobs | None] = [None] * rows
    wanted = [i for i, h in enumerate(batch.host) if h is not None and h.logprobs is not None]
    if not wanted:
        return per_draft, final
    at = [(i, j) for i in wanted for j in range(accepted[i] + 1)]
    dev = logits.device
    flat = logits[torch.tensor([i for i, _ in at], device=dev), torch.tensor([j for _, j in at], device=dev)]
    chosen = torch.tensor([drafts[i][j] if j < accepted[i] else int(tokens[i]) for i, j in at], dtype=torch.int64,
                          device=dev)
    hosts = [batch.host[i] for i, _ in at]
    entries = gather_logprobs(flat, chosen, SamplingBatch([0.0] * len(at), [0] * len(at), [1.0] * len(at), host=hosts))
    for (i, j), entry in zip(at, entries):
        assert entry is not None
        if j < accepted[i]:
            per_draft[i].append(entry)
        else:
            final[i] = entry
    return per_draft, final


def _processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits after the rules that apply before temperature, in vLLM's order: the grammar
    bitmask (vLLM applies it to the logits before the sampler), allowed token ids, bad words,
    min_tokens' blocked ids and logit_bias, then repetition, frequency and presence penalties.
    Returns `logits` itself when no row has any.

    The rules that only forbid tokens (-inf) commute with each other and with what follows
    (a bias or a penalty leaves -inf at -inf), so the two that whole batches carry, grammar
    bitmasks and min_tokens' blocked ids, are applied to every row at once; only rows with
    per-request host options (rare) are visited one by one."""
    masked = [i for i, mask in enumerate(batch.bitmasks) if mask]
    blocked = [(i, ids) for i, ids in enumerate(batch.blocked_token_ids) if ids]
    hosted = [i for i, host in enumerate(batch.host) if host is not None and host.active]
    if not (masked or blocked or hosted):
        return logits
    logits = logits.float().clone()
    vocab = logits.shape[-1]
    if masked:
        allowed = bitmasks_allowed([batch.bitmasks[i] for i in masked], vocab).to(logits.device)
        rows = torch.tensor(masked, device=logits.device)
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    if blocked:
        rows = torch.tensor([i for i, ids in blocked for _ in ids], device=logits.device)
        cols = torch.tensor([t for _, ids in blocked for t in ids], device=logits.device)
        logits[rows, cols] = float("-inf")
    for i in hosted:
        row, host = logits[i], batch.host[i]
        if host.allowed_token_ids:
            banned = torch.ones(vocab, dtype=torch.bool, device=row.device)
            banned[host.allowed_token_ids] = False
            row.masked_fill_(banned, float("-inf"))
        for word in host.bad_words:
            if _ends_with(host.output_token_ids, word[:-1]):
                row[word[-1]] = float("-inf")
        if host.logit_bias:
            ids = torch.tensor(list(host.logit_bias), dtype=torch.long, device=row.device)
            row[ids] += torch.tensor(list(host.logit_bias.values()), dtype=row.dtype, device=row.device)
        if host.has_penalties:
            _apply_penalties(row, host)
    return logits


def bitmasks_allowed(bitmasks: list[bytes], vocab: int) -> torch.Tensor:
    """[len(bitmasks), vocab] bool, unpacked in one pass (see bitmask_allowed); masks of
    different lengths are padded with zero bytes (disallowed)."""
    width = max(len(m) for m in bitmasks)
    packed = bytearray(b"".join(m.ljust(width, b"\0") for m in bitmasks))
    bits = torch.frombuffer(packed, dtype=torch.uint8).view(len(bitmasks), width)
    allowed = ((bits.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(1).bool()
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    return torch.cat([allowed, torch.zeros(len(bitmasks), vocab - allowed.shape[1], dtype=torch.bool)], dim=1)


def bitmask_allowed(bitmask: bytes, vocab: int) -> torch.Tensor:
    """[vocab] bool: the tokens a grammar bitmask allows (bit i of little-endian int32 words,
    i.e. bit i % 8 of byte i // 8); ids past the mask's end are not allowed."""
    bits = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).flatten().bool()
    if allowed.numel() >= vocab:
        return allowed[:vocab]
    return torch.cat([allowed, torch.zeros(vocab - allowed.numel(), dtype=torch.bool)])


def _ends_with(tokens: list[int], prefix: list[int]) -> bool:
    """vLLM's bad-words rule: the output so far ends with the word's ids before its last."""
    return len(prefix) <= len(tokens) and (not prefix or tokens[-len(prefix):] == prefix)


def _apply_penalties(row: torch.Tensor, host: HostSampling) -> None:
    """vLLM's penalties (model_executor/layers/utils.py apply_penalties), in place: repetition
    over prompt and output tokens (positive logits divided, others multiplied), then frequency
    (times the count) and presence (once) over the output tokens."""
    vocab = row.shape[-1]
    output = torch.tensor(host.output_token_ids, dtype=torch.long, device=row.device)
    counts = torch.bincount(output, minlength=vocab)[:vocab].to(row.dtype)
    seen = counts > 0
    if host.repetition_penalty != 1.0:
        repeated = seen.clone()
        if host.prompt_token_ids:
            repeated[torch.tensor(host.prompt_token_ids, dtype=torch.long, device=row.device)] = True
        penalty = host.repetition_penalty
        scaling = torch.where(row > 0, 1.0 / penalty, penalty)
        row.mul_(torch.where(repeated, scaling, torch.ones_like(scaling)))
    if host.frequency_penalty:
        row.sub_(host.frequency_penalty * counts)
    if host.presence_penalty:
        row.sub_(host.presence_penalty * seen.to(row.dtype))


def gather_logprobs(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch
                    ) -> list[TokenLogprobs | None]:
    """Logprobs of each row's sampled token and its top-k, for the rows that asked.

    vLLM's default logprobs_mode "raw_logprobs": the log-softmax of the model's logits before
    any rule, penalty, temperature or top-k/top-p (`logits` must be those raw logits). The rank
    counts the tokens at least as likely as the sampled one (1 = most likely), as vLLM's
    batched_count_greater_than does.
    """
    wanted = [(i, h.logprobs) for i, h in enumerate(batch.host)
              if h is not None and h.logprobs is not None]
    if not wanted:  # the common case: no thread switch for nothing
        return [None] * len(batch)
    return _wanted_logprobs(logits, tokens, wanted, len(batch))


@_one_thread_when_small
def _wanted_logprobs(logits: torch.Tensor, tokens: torch.Tensor, wanted: list[tuple[int, int]],
                     rows_in_batch: int) -> list[TokenLogprobs | None]:
    result: list[TokenLogprobs | None] = [None] * rows_in_batch
    rows = torch.tensor([i for i, _ in wanted], dtype=torch.long, device=logits.device)
    raw = logits[rows].float().log_softmax(dim=-1)
    top_logprobs, top_ids = raw.topk(max(k for _, k in wanted), dim=-1)
    sampled = tokens[rows].to(logits.device).long().unsqueeze(-1)
    sampled_logprobs = raw.gather(-1, sampled)
    ranks = (raw >= sampled_logprobs).sum(dim=-1)
    for j, (i, k) in enumerate(wanted):
        result[i] = TokenLogprobs(token_ids=[int(sampled[j, 0])] + top_ids[j, :k].tolist(),
                                  logprobs=[float(sampled_logprobs[j, 0])] + top_logprobs[j, :k].tolist(),
                                  rank=int(ranks[j]))
    return result


def _filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                    top_p: torch.Tensor, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax of logits/temperature restricted to each row's min-p, top-k and then top-p set.

    Every row keeps at least its most likely token, so no row ends with all-zero probabilities.
    One softmax, then each filter zeroes probabilities in place and the survivors are
    renormalised once at the end (top-p compares with top_p times what survived top-k and
    min-p: the mass they would hold renormalised). Ranking probabilities ranks the scaled
    logits: exp is monotonic.
    """
    # Temperature 1 (OpenAI's default) leaves the logits as they are: no [rows, vocab] pass.
    scaled = logits if bool((temperature == 1).all()) else logits / temperature.unsqueeze(-1)
    probs = scaled.softmax(dim=-1)
    filtered = False

    if min_p is not None and bool((min_p > 0).any()):
        # vLLM's MinPLogitsProcessor: drop tokens less likely than min_p times the top token.
        probs.masked_fill_(probs < probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1), 0.0)
        filtered = True

    vocab = probs.shape[-1]
    limited = (top_k > 0) & (top_k < vocab)
    if bool(limited.any()):
        # The k-th largest probability of each row is its threshold; ties at the threshold are
        # kept. topk of the widest k, not a sort of the vocabulary.
        k = torch.where(limited, top_k, 1)
        kth = probs.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))
        probs.masked_fill_(probs < torch.where(limited.unsqueeze(-1), kth, 0.0), 0.0)
        filtered = True

    if bool((top_p < 1).any()):
        mass = probs.sum(dim=-1) if filtered else None
        probs.masked_fill_(probs < _top_p_threshold(probs, top_p, mass), 0.0)
        filtered = True

    return probs.div_(probs.sum(dim=-1, keepdim=True)) if filtered else probs


# How many of a row's most likely tokens top-p ranks (topk) before it ranks more of them, and
# at last its whole vocabulary (sort). On a 2-core EPYC at 32 x 49,152: topk of 64 1.3 ms, of
# 1,024 7.2 ms, a sort 56 ms.
TOP_P_CANDIDATES = (64, 1024)


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor, mass: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """[n, 1]: the smallest probability top-p keeps in each row of probs [n, V], whose rows sum
    to mass [n] (None: 1); a row with top_p >= 1 keeps everything (0).

    Ranked by probability, a token is dropped when the tokens above it already hold more than
    top_p, so the last one kept is the first whose inclusive cumulative mass passes top_p (the
    nucleus: the fewest top tokens holding more than top_p), and every token at least as likely
    is kept: ties at the threshold are kept, as top-k keeps them, instead of an arbitrary few of
    them by sort order. A row's top few tokens hold that one in practice; a row where they do
    not (a flat distribution, top_p near 1) ranks more (TOP_P_CANDIDATES)."""
    n, vocab = probs.shape
    threshold = torch.zeros(n, 1, dtype=probs.dtype, device=probs.device)
    nucleus = top_p < 1
    top_p = top_p if mass is None else top_p * mass
    rows = None if bool(nucleus.all()) else nucleus.nonzero().flatten()  # None: every row
    for width in (*TOP_P_CANDIDATES, vocab):
        width = min(width, vocab)
        mine = probs if rows is None else probs[rows]
        ranked = mine.topk(width, dim=-1).values if width < vocab else mine.sort(dim=-1, descending=True).values
        kept, found = _first_past(ranked, top_p if rows is None else top_p[rows])
        # 0 (keep all) where none passed: final only at the whole vocabulary.
        if rows is None:
            threshold = kept
        else:
            threshold[rows] = kept
        if width == vocab or bool(found.all()):
            break
        rows = (~found).nonzero().flatten() if rows is None else rows[~found]
    return threshold


def _first_past(ranked: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For probabilities ranked [m, w] (each row descending, a row's top w): the probability of
    the first rank whose inclusive cumulative mass passes top_p [m] ([m, 1], 0 where none does),
    and whether one does [m]."""
    reached = ranked.cumsum(dim=-1) > top_p.unsqueeze(-1)
    found = reached.any(dim=-1)
    kept = ranked.gather(-1, reached.int().argmax(dim=-1, keepdim=True))
    return torch.where(found.unsqueeze(-1), kept, 0.0), found
